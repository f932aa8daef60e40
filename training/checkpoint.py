"""Checkpoints of a run: written atomically, found again by `trainer.resume=auto` and by eval.py.

    <run_dir>/checkpoints/step_00000100/
        accelerate/          optimizer and every rank's RNG state (accelerate.save_state; FSDP-aware); under FSDP
                             also the sharded model state
        model/               the weights (save_pretrained: what a plain or DDP resume reads), config.json with its
                             remote code (modeling_hilo.py) and the tokenizer as transformers files:
                             AutoModelForCausalLM / AutoTokenizer / pipeline(this), docs/checkpoints.md
        tokenizer/           what load_tokenizer needs to rebuild the run's tokenizer elsewhere
        loader/rank00000.pt  each rank's data-loader state (source position, leftover tokens, RNG, counts)
        scheduler.pt         the lr schedule's state
        trainer_state.json   step, tokens, skipped steps, W&B run id, number of processes
        config.yaml          the run's resolved config
        manifest.json        every other file's relative path, size and SHA-256 (written last)
    <run_dir>/checkpoints/latest   the name of the newest complete checkpoint

A checkpoint is written under step_XXXXXXXX.tmp; when every file is written, the manifest is written, every file and
directory is fsynced, and the directory is renamed. A crash never leaves a partial checkpoint under a real name,
and older checkpoints are pruned only after the new one exists. A failed write (a full disk) removes the .tmp
directory and raises CheckpointWriteError; the earlier checkpoints are untouched.

Reading: every file is loaded as data only (safetensors, JSON, YAML, torch.load(weights_only=True), DCP metadata
through an allowlist): a file that would need code to rebuild is refused (UnsafeCheckpointError), never run.
`trainer.resume=auto` takes the newest checkpoint that verifies against its manifest, warns about each newer one it
skips and why, and stops (CheckpointError) rather than start from scratch over checkpoints it cannot read
(docs/robustness.md).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from omegaconf import OmegaConf

STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
RNG_GLOB = "random_states_*.pkl"  # accelerate.save_state's per-rank RNG files (under accelerate/)


class CheckpointError(RuntimeError):
    """A checkpoint (or every checkpoint of a run) that cannot be used; the message names the file and the way out."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that only a code-running load could rebuild: refused, not loaded."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (a full disk, a write error); its .tmp directory has been removed."""


def is_checkpoint(path: Path) -> bool:
    return (Path(path) / STATE_FILE).is_file()


# -- reading files as data only ----------------------------------------------------------------------------------
_WAY_OUT = ("resume from another checkpoint (trainer.resume=<run_dir>/checkpoints/step_XXXXXXXX) or start a new run "
            "(trainer.resume=none name=<new name>)")


def load_data(path: Path, **kwargs):
    """torch.load(path) as data only (weights_only=True: tensors, numbers, strings, lists, dicts). A file that holds
    other objects is refused with UnsafeCheckpointError (nothing in it runs); an unreadable one raises
    CheckpointError. Both name the file."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        text = str(e)
        if "GLOBAL" in text:  # a pickled reference to a Python callable: what runs code on load
            what = next((line.strip() for line in text.splitlines() if "GLOBAL" in line), "")
            raise UnsafeCheckpointError(
                f"{path}: refused: the file holds Python objects that only a code-running load (weights_only=False) "
                f"could rebuild ({what}). hilo's checkpoints hold only tensors and plain data, so this file was "
                f"written by something else or tampered with; {_WAY_OUT}. Only if you wrote the file yourself and "
                f"trust it, re-save it as data: torch.save(torch.load(path, weights_only=False), path)") from None
        raise CheckpointError(f"{path}: not a data-only torch file (damaged or not written by hilo); "
                              f"{_WAY_OUT}") from None
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {_WAY_OUT}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read, the file is truncated or damaged "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); {_WAY_OUT}") from None


# torch.distributed.checkpoint reads its .metadata files with a plain pickle.load (which would run code). These are
# the globals its Metadata pickles reference; check_dcp_metadata unpickles with only them allowed before DCP reads it.
_DCP_GLOBALS = {("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
                ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


class _DCPMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == "torch.distributed.checkpoint.metadata" or (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not part of torch.distributed.checkpoint metadata")


def check_dcp_metadata(path: Path) -> None:
    """Refuse a torch.distributed.checkpoint .metadata file that references anything but DCP's own metadata types."""
    try:
        with open(path, "rb") as f:
            _DCPMetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        if "GLOBAL" in str(e):
            raise UnsafeCheckpointError(
                f"{path}: refused: {e}; the file could run code if loaded; {_WAY_OUT}") from None
        raise CheckpointError(f"{path}: cannot be read, damaged ({e}); {_WAY_OUT}") from None
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {_WAY_OUT}") from None
    except (EOFError, OSError, ValueError, AttributeError, TypeError, IndexError) as e:
        raise CheckpointError(f"{path}: cannot be read, damaged ({type(e).__name__}: {e}); {_WAY_OUT}") from None


def _load_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {_WAY_OUT}") from None
    except (ValueError, UnicodeDecodeError, OSError) as e:
        raise CheckpointError(f"{path}: cannot be read, damaged ({e}); {_WAY_OUT}") from None


# -- the manifest ------------------------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(ckpt: Path) -> dict:
    """Write ckpt/manifest.json: every file under ckpt (relative path -> size, SHA-256), via a fsynced temporary.
    hashlib releases the GIL, so the files are hashed in parallel threads."""
    files = _files_under(ckpt)
    with ThreadPoolExecutor(max_workers=min(8, len(files) or 1)) as pool:
        digests = list(pool.map(_sha256, files))
    manifest = {"version": MANIFEST_VERSION,
                "files": {f.relative_to(ckpt).as_posix(): {"size": f.stat().st_size, "sha256": d}
                          for f, d in zip(files, digests)}}
    write_durably(ckpt / MANIFEST, json.dumps(manifest, indent=1).encode())
    return manifest


def verify_checkpoint(ckpt: Path) -> list[str]:
    """Check a checkpoint before it is loaded; raise CheckpointError naming the first damaged file. Return warnings
    for damage that only costs exactness (an RNG file).

    With a manifest: every listed file must be present with its size and SHA-256. Without one (a checkpoint written
    before manifests): the state files are read as data (trainer_state.json, config.yaml, scheduler.pt,
    loader/*.pt, the safetensors headers, the optimizer state, DCP metadata). Either way every DCP .metadata file is
    checked against the allowlist, because DCP unpickles it without restriction."""
    ckpt = Path(ckpt)
    notes: list[str] = []
    if (ckpt / MANIFEST).exists():
        manifest = _load_json(ckpt / MANIFEST)
        if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION or "files" not in manifest:
            raise CheckpointError(f"{ckpt / MANIFEST}: not a hilo checkpoint manifest (version "
                                  f"{manifest.get('version') if isinstance(manifest, dict) else None}); {_WAY_OUT}")
        for rel, entry in manifest["files"].items():
            f = ckpt / rel
            problem = None
            if not f.is_file():
                problem = "missing"
            elif f.stat().st_size != entry["size"]:
                problem = f"{f.stat().st_size} bytes, the manifest says {entry['size']} (truncated or overwritten)"
            elif _sha256(f) != entry["sha256"]:
                problem = "its contents do not match the manifest's SHA-256 (damaged or changed)"
            if problem is None:
                continue
            if f.match(RNG_GLOB) and f.parent.name == "accelerate":
                notes.append(f"{f}: {problem}")
                continue
            raise CheckpointError(f"{f}: {problem}; {_WAY_OUT}")
        if STATE_FILE not in manifest["files"]:
            raise CheckpointError(f"{ckpt / MANIFEST} does not list {STATE_FILE}; {_WAY_OUT}")
    else:
        _verify_unlisted(ckpt, notes)
    for meta in sorted((ckpt / "accelerate").rglob(".metadata")):
        check_dcp_metadata(meta)
    return notes


def _verify_unlisted(ckpt: Path, notes: list[str]) -> None:
    """The reads that stand in for a manifest in a checkpoint written without one."""
    from safetensors import SafetensorError, safe_open

    state = _load_json(ckpt / STATE_FILE)
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"{ckpt / STATE_FILE}: holds no step; {_WAY_OUT}")
    try:
        OmegaConf.load(ckpt / "config.yaml")
    except Exception as e:  # noqa: BLE001  (yaml raises many types; any of them means unreadable)
        raise CheckpointError(f"{ckpt / 'config.yaml'}: cannot be read ({type(e).__name__}: {e}); {_WAY_OUT}") from None
    load_data(ckpt / "scheduler.pt")
    world = int(state.get("world_size") or 1)
    expected = {ckpt / "loader" / f"rank{r:05d}.pt" for r in range(world)}  # present or not: each is read
    for f in sorted({*(ckpt / "loader").glob("rank*.pt"), *expected}):
        load_data(f)
    acc_dir = ckpt / "accelerate"
    try:
        layout = saved_layout(acc_dir)
    except FileNotFoundError as e:
        raise CheckpointError(str(e)) from None
    if layout == "plain" and weights_in_model_dir(acc_dir) and not any((ckpt / "model").glob("*.safetensors")):
        raise CheckpointError(f"{ckpt / 'model' / 'model.safetensors'}: missing (model/ holds no .safetensors "
                              f"weights, the model state of this checkpoint); {_WAY_OUT}")
    for f in sorted([*acc_dir.glob("*.safetensors"), *(ckpt / "model").glob("*.safetensors")]):
        try:
            with safe_open(str(f), framework="pt") as sf:
                for key in list(sf.keys())[:1]:
                    sf.get_slice(key)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{f}: cannot be read, truncated or damaged ({e}); {_WAY_OUT}") from None
    if layout == "plain":
        load_data(acc_dir / "optimizer.bin", mmap=True)
    for f in sorted(acc_dir.glob(RNG_GLOB)):
        try:
            _load_rng(f)
        except CheckpointError as e:
            notes.append(_reason(e))


def _load_rng(path: Path) -> dict:
    """An accelerate RNG file read as accelerate reads it (weights_only with its numpy allowlist)."""
    from accelerate.utils.other import load

    try:
        states = load(path)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: refused or damaged ({str(e).splitlines()[-3:]})") from None
    except Exception as e:  # noqa: BLE001  (torch.load's errors for damaged files are of many types)
        raise CheckpointError(f"{path}: cannot be read ({type(e).__name__})") from None
    if not isinstance(states, dict) or "torch_manual_seed" not in states:
        raise CheckpointError(f"{path}: not an accelerate RNG state")
    return states


def _reason(e: Exception) -> str:
    """A CheckpointError's message without the way out (when it is listed with others)."""
    return str(e).split("; " + _WAY_OUT)[0]


def _checkpoint_dirs(ckpt_dir: Path) -> list[Path]:
    """Every finished (renamed) step directory, complete or not, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.glob("step_*") if p.is_dir() and re.fullmatch(r"step_\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def select_resume_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest checkpoint of ckpt_dir that verifies (verify_checkpoint), warning about each newer one skipped and
    why; None when ckpt_dir holds no checkpoint at all. Raises CheckpointError, naming every damaged file and the
    way out, when it holds checkpoints and none verifies: a fresh start would mix two runs in one directory."""
    ckpt_dir = Path(ckpt_dir)
    candidates = _checkpoint_dirs(ckpt_dir)
    skipped = []
    for ckpt in reversed(candidates):
        try:
            notes = verify_checkpoint(ckpt)
        except CheckpointError as e:
            skipped.append(f"{ckpt.name}: {_reason(e)}")
            warnings.warn(f"skipping checkpoint {ckpt}: {_reason(e)}", stacklevel=2)
            continue
        for note in notes:
            warn_not_exact(note)
        return ckpt
    if skipped:
        raise CheckpointError(
            f"{ckpt_dir} holds {len(candidates)} checkpoint(s) and none can be resumed:\n  " + "\n  ".join(skipped)
            + f"\nRepair or restore the damaged files and resume that checkpoint with "
              f"trainer.resume={ckpt_dir}/step_XXXXXXXX, or start over as a new run with trainer.resume=none "
              f"name=<new name> (this directory is left as it is)")
    return None


def warn_not_exact(why: str) -> None:
    warnings.warn(f"{why}: the RNG state cannot be restored, so the resumed run will not be bit-exact (dropout and "
                  f"any other random draws differ from an uninterrupted run)", stacklevel=3)


# -- writing durably ---------------------------------------------------------------------------------------------
def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """path's new contents in full or not at all: a fsynced temporary, os.replace, then the directory fsynced."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*"), key=lambda q: -len(q.parts)):  # files and subdirectories before their parents
        _fsync_path(p)
    _fsync_path(root)


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _write_error(final: Path, err: BaseException) -> CheckpointWriteError:
    """The error a failed save raises: 'disk full' when the OS said so (or when torch's writer hid the errno and the
    disk has under 1 GiB free), always the checkpoint path and the free space."""
    try:
        free = shutil.disk_usage(final.parent).free
    except OSError:
        free = None
    chain = [e for e in (err, err.__cause__, err.__context__) if e is not None]
    errnos = [getattr(e, "errno", None) for e in chain]
    # safetensors (Rust) says "os error 28"; torch's zip writer hides the errno behind "unexpected pos"
    errnos += [int(n) for e in chain for n in re.findall(r"os error (\d+)", str(e))]
    full = (any(n in _FULL for n in errnos) or any("unexpected pos" in str(e) for e in chain)
            or (free is not None and free < 1 << 30))
    where = getattr(err, "filename", None) or final.with_name(final.name + ".tmp")
    free_text = "" if free is None else f" ({free / 2**20:.0f} MiB free on that file system)"
    what = "disk full" if full else "write error"
    first_line = str(err).splitlines()[0] if str(err) else ""
    return CheckpointWriteError(
        f"saving checkpoint {final.name} failed, {what}: {type(err).__name__}: {first_line} "
        f"while writing {where}{free_text}. The partial checkpoint was removed and the earlier checkpoints are "
        f"intact; free space (or fix the path) and continue with trainer.resume=auto")


def _complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    return [p for p in _checkpoint_dirs(ckpt_dir) if is_checkpoint(p)]


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory from a checkpoint directory, a run directory or a run's checkpoints/ directory."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"checkpoint path {str(p)!r} does not exist; pass a run directory (runs/<name>) or one of its "
            f"checkpoints (runs/<name>/checkpoints/step_XXXXXXXX)")
    if is_checkpoint(p):
        return p
    for ckpt_dir in (p / "checkpoints", p):
        latest_file = ckpt_dir / "latest"
        if latest_file.is_file():
            candidate = ckpt_dir / latest_file.read_text().strip()
            if is_checkpoint(candidate):
                return candidate
        found = _complete_checkpoints(ckpt_dir)
        if found:
            return found[-1]
    raise FileNotFoundError(f"{str(p)!r} holds no complete checkpoint (no step_*/{STATE_FILE}); train first or "
                            f"point at a run directory that has one")


def load_checkpoint_model(path: str | os.PathLike, **from_pretrained_kwargs):
    """The HF model saved in a checkpoint (or in a run directory's newest checkpoint)."""
    from transformers import AutoModelForCausalLM

    import models  # noqa: F401  (registers the hilo architectures with the Auto classes)

    ckpt = resolve_checkpoint(path)
    return AutoModelForCausalLM.from_pretrained(ckpt / "model", **from_pretrained_kwargs)


class InitFromError(ValueError):
    """trainer.init_from names a checkpoint whose weights or tokenizer do not fit the new run."""


def _pieces(tokenizer) -> list[str]:
    return [tokenizer.decode([i]) for i in range(int(tokenizer.vocab_size))]


def init_weights_from(model, path: str | os.PathLike, run_cfg: dict, tokenizer=None) -> list[str]:
    """trainer.init_from: a new run's freshly built model takes the weights of a checkpoint (or of a run directory's
    newest one), while its optimizer, schedule, data stream and step count start fresh: a curriculum's next stage
    (longer documents, other data) or a context extension. Refused (InitFromError, naming the problem and the fix)
    when the weights do not fit the model (another architecture or size: names or shapes differ) or, when tokenizer
    is given, when the checkpoint's tokenizer maps ids to other pieces. Returns the lines to log: where the weights
    come from, and each setting of the checkpoint's model config that this run changes (one that keeps every
    weight's shape, such as rope_theta or a dropout)."""
    from training.resume_check import compare_configs

    ckpt = resolve_checkpoint(path)
    saved = OmegaConf.to_container(OmegaConf.load(ckpt / "config.yaml"), resolve=True)
    blocking, applied = compare_configs({"model": saved.get("model", {})}, {"model": run_cfg["model"]})
    changed = blocking + applied
    try:
        load_model_weights(model, ckpt)
    except CheckpointError as e:
        raise InitFromError(f"trainer.init_from={str(path)!r}: {str(e).split('; ')[0]}; the run's model differs from "
                            f"the checkpoint's in " + (", ".join(changed) or "nothing its config shows")
                            + ". Build the checkpoint's model (its config.yaml), or start from scratch "
                            "(trainer.init_from=null)") from None
    if tokenizer is not None and (ckpt / "tokenizer" / TOKENIZER_FILE).is_file():
        theirs = load_checkpoint_tokenizer(ckpt)
        if _pieces(theirs) != _pieces(tokenizer):
            raise InitFromError(f"trainer.init_from={str(path)!r}: the checkpoint's tokenizer ({theirs.name}, "
                                f"{theirs.vocab_size} ids) maps ids to other pieces than this run's ({tokenizer.name}, "
                                f"{tokenizer.vocab_size} ids), so its embeddings would read the wrong tokens; use the "
                                f"checkpoint's tokenizer settings (its config.yaml, tokenizer:)")
    state = _load_json(ckpt / STATE_FILE)
    return [f"init: weights from {ckpt} (step {state.get('step')}); optimizer, schedule and data start fresh",
            *(f"init: {line}" for line in changed)]


def load_checkpoint_config(path: str | os.PathLike):
    """The resolved training config saved with a checkpoint."""
    return OmegaConf.load(resolve_checkpoint(path) / "config.yaml")


class CheckpointManager:
    def __init__(self, ckpt_dir: Path, keep_last: int, accelerator):
        self.dir = Path(ckpt_dir)
        self.keep_last = keep_last
        self.acc = accelerator

    # -- finding -------------------------------------------------------------------------------------------
    def latest(self) -> Path | None:
        try:
            return resolve_checkpoint(self.dir)
        except FileNotFoundError:
            return None

    def latest_step(self) -> int | None:
        latest = self.latest()
        return None if latest is None else int(latest.name.split("_")[1])

    def resolve_resume(self, resume: str) -> Path | None:
        """The checkpoint to continue from, or None for a fresh run.

        auto: the newest checkpoint that verifies (select_resume_checkpoint), None if there is none at all; an error,
        not a fresh start, if there are checkpoints and none verifies. none: a fresh run, refused over a directory
        that already has checkpoints (it would mix two runs and prune the old checkpoints). A path: that checkpoint
        (or that run directory's newest that verifies), verified. The main process verifies (it reads every file)
        and tells the others."""
        acc = self.acc
        result: list = [None, None]
        if acc is None or acc.is_main_process:
            try:
                result[0] = self._resolve_resume(resume)
            except (CheckpointError, FileExistsError, FileNotFoundError) as e:
                result[1] = e
        if acc is not None and acc.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            result = broadcast_object_list(result)
        if result[1] is not None:
            raise result[1]
        return result[0]

    def _resolve_resume(self, resume: str) -> Path | None:
        if resume == "auto":
            return select_resume_checkpoint(self.dir)
        if resume in ("none", "null", "false"):
            found = _checkpoint_dirs(self.dir)
            if found:
                raise FileExistsError(
                    f"{self.dir} already holds checkpoints (newest: {found[-1].name}); continue it with "
                    f"trainer.resume=auto, or start a new run with name=<new name>")
            return None
        p = Path(resume).expanduser()
        if p.is_dir() and not is_checkpoint(p) and not p.name.startswith("step_"):  # a run or checkpoints/ directory
            ckpt_dir = p / "checkpoints" if (p / "checkpoints").is_dir() else p
            if _checkpoint_dirs(ckpt_dir):
                return select_resume_checkpoint(ckpt_dir)
        ckpt = p if p.is_dir() and p.name.startswith("step_") else resolve_checkpoint(resume)
        for note in verify_checkpoint(ckpt):
            warn_not_exact(note)
        return ckpt

    # -- writing -------------------------------------------------------------------------------------------
    def save(self, model, optimizer, scheduler, loader, state: dict, cfg, tokenizer) -> Path:
        acc = self.acc
        final = self.dir / f"step_{state['step']:08d}"
        tmp = final.with_name(final.name + ".tmp")
        try:
            if acc.is_main_process:
                self.dir.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)  # an earlier interrupted write of this step; the complete ones are untouched
                tmp.mkdir()
                (tmp / "loader").mkdir()
            acc.wait_for_everyone()

            # the model's weights are written once, by save_pretrained into model/ below; accelerate's state holds
            # the optimizer and RNG states (and, under FSDP, which saves before this hook, the sharded model)
            handle = acc.register_save_state_pre_hook(lambda models, weights, output_dir: weights.clear())
            try:
                acc.save_state(str(tmp / "accelerate"))
            finally:
                handle.remove()
            state_dict = acc.get_state_dict(model)  # collective under FSDP: every rank calls it
            torch.save(loader.state_dict(), tmp / "loader" / f"rank{acc.process_index:05d}.pt")
            if acc.is_main_process:
                acc.unwrap_model(model).save_pretrained(tmp / "model", state_dict=state_dict, safe_serialization=True)
                _save_tokenizer(tokenizer, tmp / "tokenizer")
                write_hf_tokenizer(tmp / "tokenizer", tmp / "model")
                torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
                OmegaConf.save(cfg, tmp / "config.yaml", resolve=True)
                meta = dict(state, world_size=acc.num_processes)
                (tmp / STATE_FILE).write_text(json.dumps(meta, indent=2))
            acc.wait_for_everyone()
            if acc.is_main_process:
                write_manifest(tmp)  # last: a checkpoint is complete only if every file it lists verifies
                _fsync_tree(tmp)
                if final.exists():  # a checkpoint of the same step from an earlier attempt: replace it whole
                    shutil.rmtree(final)
                os.replace(tmp, final)
                _fsync_path(self.dir)
                write_durably(self.dir / "latest", final.name.encode())
        except Exception as e:
            if isinstance(e, CheckpointError):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, (OSError, RuntimeError)) or "I/O error" in str(e) or "os error" in str(e):
                raise _write_error(final, e) from e
            raise
        if acc.is_main_process:
            for old in _complete_checkpoints(self.dir)[:-self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()
        return final

    # -- reading -------------------------------------------------------------------------------------------
    def load(self, path: Path, *, model, optimizer, scheduler, loader) -> dict:
        acc = self.acc
        for dcp_meta in sorted((path / "accelerate").rglob(".metadata")):  # DCP unpickles these unrestricted
            check_dcp_metadata(dcp_meta)
        meta = _load_json(path / STATE_FILE)
        restored = {k: meta[k] for k in ("step", "tokens", "skipped_steps", "wandb_id") if k in meta}
        saved, here = saved_layout(path / "accelerate"), run_layout(acc)
        if saved == here:
            rng_file = path / "accelerate" / f"random_states_{acc.process_index}.pkl"
            try:  # accelerate reports an RNG state it cannot restore only at INFO level
                _load_rng(rng_file)
            except CheckpointError as e:
                warn_not_exact(str(e))
            handle = None
            if saved == "plain" and weights_in_model_dir(path / "accelerate"):
                load_model_weights(acc.unwrap_model(model), path)
                # accelerate then restores the optimizer and RNG states only (it reads no model file)
                handle = acc.register_load_state_pre_hook(lambda models, input_dir: models.clear())
            try:  # accelerate reads every file with weights_only=True (with a numpy allowlist for the RNG files)
                acc.load_state(str(path / "accelerate"))
            except Exception as e:  # noqa: BLE001  (name the file: accelerate's errors do not)
                _raise_naming_file(path / "accelerate", e)
            finally:
                if handle is not None:
                    handle.remove()
        else:
            load_across_layouts(path, saved, model, optimizer)
            warnings.warn(
                f"checkpoint {path} holds {LAYOUTS[saved]} and this run uses {LAYOUTS[here]}: the model weights and "
                f"the optimizer state are restored through full (unsharded) state dicts; the RNG states are not",
                stacklevel=2)
        scheduler.load_state_dict(load_data(path / "scheduler.pt"))
        loader_file = path / "loader" / f"rank{acc.process_index:05d}.pt"
        if meta.get("world_size") == acc.num_processes and loader_file.is_file():
            loader.load_state_dict(load_data(loader_file))
            return restored
        why = "the data stream restarts from its beginning with a new shard assignment"
        first = path / "loader" / "rank00000.pt"
        if hasattr(loader, "load_global_state") and first.is_file():  # data.shard=rows: one stream for every size
            try:
                loader.load_global_state(load_data(first))
                why = None
            except (ValueError, KeyError) as e:
                why = f"{why} ({e})"
        if why:
            warnings.warn(
                f"checkpoint {path} was written by {meta.get('world_size')} process(es), this run has "
                f"{acc.num_processes}: model, optimizer and schedule are restored, {why}", stacklevel=2)
        return restored


def _raise_naming_file(acc_dir: Path, err: Exception):
    """Re-raise an error of accelerate.load_state as a CheckpointError naming the file it came from (found by reading
    each state file again as data), or unchanged when no file is at fault."""
    from safetensors import SafetensorError, safe_open

    for f in sorted(acc_dir.iterdir()):
        if f.suffix == ".safetensors":
            try:
                with safe_open(str(f), framework="pt"):
                    pass  # opening parses the header: what a truncated or garbled file fails
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{f}: cannot be read, truncated or damaged ({e}); {_WAY_OUT}") from err
        elif f.suffix == ".bin":
            load_data(f, mmap=True)  # raises naming the file
    raise err


# How accelerate.save_state wrote a checkpoint's model and optimizer, and how this run's load_state reads them.
LAYOUTS = {"plain": "whole model and optimizer states (one process, or DDP)",
           "fsdp-sharded": "FSDP-sharded states (torch.distributed.checkpoint directories)",
           "fsdp-full": "FSDP full states (fsdp_state_dict_type FULL_STATE_DICT)"}
FSDP_MODEL_DIR, FSDP_OPTIMIZER_DIR = "pytorch_model_fsdp_0", "optimizer_0"


_ACCELERATE_MODEL_FILES = ("model.safetensors", "pytorch_model.bin")


def saved_layout(acc_dir: Path) -> str:
    """Which of LAYOUTS accelerate.save_state wrote in acc_dir."""
    if (acc_dir / FSDP_MODEL_DIR).is_dir():
        return "fsdp-sharded"
    if (acc_dir / "pytorch_model_fsdp.bin").is_file():
        return "fsdp-full"
    if any((acc_dir / name).is_file() for name in ("optimizer.bin", *_ACCELERATE_MODEL_FILES)):
        return "plain"
    raise FileNotFoundError(f"{acc_dir} holds no optimizer or model state written by accelerate.save_state "
                            f"(optimizer.bin missing: the checkpoint is incomplete or not hilo's); resume from "
                            f"another checkpoint")


def weights_in_model_dir(acc_dir: Path) -> bool:
    """Whether a plain checkpoint's model weights are only in model/ (save_pretrained), as hilo writes them; a
    checkpoint written before that also holds them in accelerate/, and accelerate.load_state reads them there."""
    return not any((acc_dir / name).is_file() for name in _ACCELERATE_MODEL_FILES)


def load_model_weights(model, path: Path) -> None:
    """Copy a checkpoint's model/ weights into model (unwrapped, on any device), every tensor of its state dict
    exactly: a tensor save_pretrained leaves out because it is tied (the LM head) is set through the one it shares.
    Raises CheckpointError naming the directory for a missing, damaged or mismatching file."""
    from safetensors import SafetensorError

    model_dir = path / "model"
    if not any(model_dir.glob("*.safetensors")):
        raise CheckpointError(f"{model_dir / 'model.safetensors'}: missing (model/ holds no .safetensors weights, "
                              f"the model state of this checkpoint); {_WAY_OUT}")
    try:
        weights = _full_weights(path)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{model_dir}: cannot be read, truncated or damaged ({e}); {_WAY_OUT}") from None
    current = model.state_dict(keep_vars=True)
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # shapes that differ
        raise CheckpointError(f"{model_dir}: weights of another model ({str(e).splitlines()[-1].strip()}); "
                              f"{_WAY_OUT}") from None
    loaded = {current[k].data_ptr() for k in weights if k in current}
    untied = [k for k in missing if current[k].data_ptr() not in loaded]
    if untied or unexpected:
        raise CheckpointError(f"{model_dir}: weights of another model (missing {untied[:4]}, unexpected "
                              f"{unexpected[:4]}); {_WAY_OUT}")


def run_layout(acc) -> str:
    """Which of LAYOUTS this run's accelerate.load_state reads."""
    from accelerate.utils import DistributedType

    if acc.distributed_type != DistributedType.FSDP:
        return "plain"
    sharded = str(acc.state.fsdp_plugin.state_dict_type).endswith("SHARDED_STATE_DICT")
    return "fsdp-sharded" if sharded else "fsdp-full"


def _full_weights(path: Path) -> dict:
    """The checkpoint's whole model state dict: the save_pretrained export (model/*.safetensors), which every
    layout writes from the gathered weights."""
    from safetensors.torch import load_file

    files = sorted((path / "model").glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path / 'model'} holds no .safetensors weights; the checkpoint cannot be resumed "
                                f"under another layout (resume it with the accelerate config that wrote it)")
    weights = {}
    for f in files:
        weights.update(load_file(f))
    return weights


def _full_optimizer_state(acc_dir: Path, layout: str, model, optimizer) -> dict:
    """The saved optimizer state as get_optimizer_state_dict gives it: parameters named by their fully qualified
    names, every tensor whole."""
    if layout == "fsdp-sharded":
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        # every process reads the whole state from the shards, with no collective (no_dist), as
        # torch.distributed.checkpoint.format_utils.dcp_to_torch_save does, without the file it writes
        state: dict = {}
        _load_state_dict(state, storage_reader=FileSystemReader(str(acc_dir / FSDP_OPTIMIZER_DIR)),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        return state["optimizer"]
    # plain: optimizer.state_dict(), parameters numbered in param-group order; this run's optimizer has the same
    # groups in the same order (training.optim.build_optimizer), so number i is the same parameter
    saved = load_data(acc_dir / "optimizer.bin")
    # fully qualified names as get_optimizer_state_dict gives them: no DDP wrapper prefix
    names = {id(p): n.removeprefix("module.") for n, p in model.named_parameters()}
    if [len(g["params"]) for g in saved["param_groups"]] != [len(g["params"]) for g in optimizer.param_groups]:
        raise ValueError(f"{acc_dir / 'optimizer.bin'} has param groups of sizes "
                         f"{[len(g['params']) for g in saved['param_groups']]}, this run's optimizer "
                         f"{[len(g['params']) for g in optimizer.param_groups]}: it was written for another model")
    number_to_name = {}
    for sg, g in zip(saved["param_groups"], optimizer.param_groups, strict=True):
        number_to_name.update({i: names[id(p)] for i, p in zip(sg["params"], g["params"], strict=True)})
    return {"state": {number_to_name[i]: v for i, v in saved["state"].items()},
            "param_groups": [{**sg, "params": [number_to_name[i] for i in sg["params"]]}
                             for sg in saved["param_groups"]]}


def load_across_layouts(path: Path, layout: str, model, optimizer) -> None:
    """Restore a checkpoint written under another layout (FSDP-sharded into a plain run, or the reverse): whole
    weights and optimizer state, which torch.distributed.checkpoint.state_dict shards as this run's model is."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if layout == "fsdp-full":
        raise ValueError(f"checkpoint {path} holds FSDP full states (FULL_STATE_DICT), which only an FSDP run with "
                         f"that setting resumes; hilo's conf/accelerate/fsdp.yaml writes SHARDED_STATE_DICT")
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, _full_weights(path), options=options)
    set_optimizer_state_dict(model, optimizer, _full_optimizer_state(path / "accelerate", layout, model, optimizer),
                             options=options)


TOKENIZER_FILE = "hilo_tokenizer.json"


def _save_tokenizer(tokenizer, out: Path) -> None:
    """Copy what rebuilds the run's tokenizer into the checkpoint, so eval works on a machine without the cache."""
    out.mkdir(parents=True, exist_ok=True)
    if getattr(tokenizer, "model_path", None):  # SentencePiece
        shutil.copyfile(tokenizer.model_path, out / "tokenizer.model")
        spec = {"type": "sentencepiece", "file": "tokenizer.model"}
    elif hasattr(tokenizer, "tok") and hasattr(tokenizer.tok, "save_pretrained"):  # HF tokenizer
        tokenizer.tok.save_pretrained(out)
        spec = {"type": "hf", "file": "."}
    else:
        raise TypeError(f"cannot save tokenizer {tokenizer!r}: expected a SentencePiece or HF tokenizer")
    (out / TOKENIZER_FILE).write_text(json.dumps({**spec, "name": getattr(tokenizer, "name", None)}))


def write_hf_tokenizer(tok_dir: Path, out: Path) -> tuple[object, str]:
    """Write a checkpoint's tokenizer (its tokenizer/ directory) as transformers tokenizer files in out, with bos,
    eos and a pad token set (pad = eos when the tokenizer has none), so AutoTokenizer.from_pretrained(out) and
    batched pipeline() calls work from out alone; returns (the transformers tokenizer, a note on what was written).
    A SentencePiece model is rebuilt with the same ids (data.tokenizer.sentencepiece_to_hf, which raises
    TokenizerConversionError for one it cannot rebuild); an HF tokenizer's files are copied as the run saved them
    and rewritten only to add the pad token."""
    from transformers import AutoTokenizer

    from data.tokenizer import TokenizerConversionError, sentencepiece_to_hf

    tok_dir, out = Path(tok_dir), Path(out)
    spec = json.loads((tok_dir / TOKENIZER_FILE).read_text())
    if spec["type"] == "sentencepiece":
        tok = sentencepiece_to_hf(tok_dir / spec["file"])
        note = "SentencePiece model -> tokenizer.json (pad = eos: the model has no pad piece)"
        rewrite = True
    elif spec["type"] == "hf":
        src = tok_dir / spec["file"]
        for f in src.iterdir():  # beside a model's files (a checkpoint's model/), which are not replaced
            if f.is_file() and f.name != TOKENIZER_FILE and not (out / f.name).exists():
                shutil.copyfile(f, out / f.name)
        tok = AutoTokenizer.from_pretrained(out)
        note = "transformers tokenizer files, copied"
        rewrite = tok.pad_token is None
        if rewrite:
            tok.pad_token = tok.eos_token
            note += " (pad = eos: the tokenizer has none)"
    else:
        raise TokenizerConversionError(f"{str(tok_dir)!r} holds a tokenizer of type {spec['type']!r}: only "
                                       f"sentencepiece and hf tokenizers are written as transformers files")
    if rewrite:
        tok.save_pretrained(out)
        # PreTrainedTokenizerFast is what transformers 4 and 5 both build from tokenizer.json (5 writes its own
        # backend's class name, which 4 does not know)
        cfg_file = out / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text())
        if cfg.get("tokenizer_class") == "TokenizersBackend":
            cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
            cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")
    if not (out / "special_tokens_map.json").is_file():  # transformers 5 keeps them in tokenizer_config.json only
        (out / "special_tokens_map.json").write_text(json.dumps(tok.special_tokens_map, indent=2) + "\n")
    return tok, note


def load_checkpoint_tokenizer(path: str | os.PathLike):
    """The tokenizer saved with a checkpoint (or a run directory's newest checkpoint)."""
    from data import load_tokenizer

    tok_dir = resolve_checkpoint(path) / "tokenizer"
    spec = json.loads((tok_dir / TOKENIZER_FILE).read_text())
    target = str((tok_dir / spec["file"]).resolve())
    if spec["type"] == "sentencepiece":
        return load_tokenizer({"type": "sentencepiece", "model_path": target})
    return load_tokenizer({"type": "hf", "name_or_path": target})
