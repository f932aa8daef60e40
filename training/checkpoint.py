"""Checkpoints of a run: written atomically, found again by `trainer.resume=auto` and by eval.py.

    <run_dir>/checkpoints/step_00000100/
        accelerate/          model, optimizer and every rank's RNG state (accelerate.save_state; FSDP-aware)
        model/               save_pretrained export: AutoModelForCausalLM.from_pretrained(this) after `import models`
        tokenizer/           what load_tokenizer needs to rebuild the run's tokenizer elsewhere
        loader/rank00000.pt  each rank's data-loader state (source position, leftover tokens, RNG, counts)
        scheduler.pt         the lr schedule's state
        trainer_state.json   step, tokens, skipped steps, W&B run id, number of processes
        config.yaml          the run's resolved config
    <run_dir>/checkpoints/latest   the name of the newest complete checkpoint

A checkpoint is written under step_XXXXXXXX.tmp and renamed when complete, so a crash never leaves a partial
checkpoint under a real name, and older checkpoints are pruned only after the new one exists.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
from omegaconf import OmegaConf

STATE_FILE = "trainer_state.json"


def is_checkpoint(path: Path) -> bool:
    return (Path(path) / STATE_FILE).is_file()


def _complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp") and is_checkpoint(p)]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


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
        """The checkpoint to continue from, or None for a fresh run; refuses to start a fresh run over a run
        directory that already has checkpoints (it would mix two runs and prune the old checkpoints)."""
        latest = self.latest()
        if resume == "auto":
            return latest
        if resume in ("none", "null", "false"):
            if latest is not None:
                raise FileExistsError(
                    f"{self.dir} already holds checkpoints (newest: {latest.name}); continue it with "
                    f"trainer.resume=auto, or start a new run with name=<new name>")
            return None
        return resolve_checkpoint(resume)

    # -- writing -------------------------------------------------------------------------------------------
    def save(self, model, optimizer, scheduler, loader, state: dict, cfg, tokenizer) -> Path:
        acc = self.acc
        final = self.dir / f"step_{state['step']:08d}"
        tmp = final.with_name(final.name + ".tmp")
        if acc.is_main_process:
            self.dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # an earlier interrupted write of this step; the complete ones are untouched
            tmp.mkdir()
            (tmp / "loader").mkdir()
        acc.wait_for_everyone()

        acc.save_state(str(tmp / "accelerate"))
        state_dict = acc.get_state_dict(model)  # collective under FSDP: every rank calls it
        torch.save(loader.state_dict(), tmp / "loader" / f"rank{acc.process_index:05d}.pt")
        if acc.is_main_process:
            acc.unwrap_model(model).save_pretrained(tmp / "model", state_dict=state_dict, safe_serialization=True)
            _save_tokenizer(tokenizer, tmp / "tokenizer")
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            OmegaConf.save(cfg, tmp / "config.yaml", resolve=True)
            meta = dict(state, world_size=acc.num_processes)
            (tmp / STATE_FILE).write_text(json.dumps(meta, indent=2))
        acc.wait_for_everyone()
        if acc.is_main_process:
            if final.exists():  # a checkpoint of the same step from an earlier attempt: replace it whole
                shutil.rmtree(final)
            os.replace(tmp, final)
            latest_tmp = self.dir / "latest.tmp"
            latest_tmp.write_text(final.name)
            os.replace(latest_tmp, self.dir / "latest")
            for old in _complete_checkpoints(self.dir)[:-self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()
        return final

    # -- reading -------------------------------------------------------------------------------------------
    def load(self, path: Path, *, optimizer, scheduler, loader) -> dict:
        acc = self.acc
        meta = json.loads((path / STATE_FILE).read_text())
        acc.load_state(str(path / "accelerate"))
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
        loader_file = path / "loader" / f"rank{acc.process_index:05d}.pt"
        if meta.get("world_size") == acc.num_processes and loader_file.is_file():
            loader.load_state_dict(torch.load(loader_file, weights_only=False))
        else:
            warnings.warn(
                f"checkpoint {path} was written by {meta.get('world_size')} process(es), this run has "
                f"{acc.num_processes}: model, optimizer and schedule are restored, the data stream restarts "
                f"from its beginning with a new shard assignment", stacklevel=2)
        return {k: meta[k] for k in ("step", "tokens", "skipped_steps", "wandb_id") if k in meta}


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


def load_checkpoint_tokenizer(path: str | os.PathLike):
    """The tokenizer saved with a checkpoint (or a run directory's newest checkpoint)."""
    from data import load_tokenizer

    tok_dir = resolve_checkpoint(path) / "tokenizer"
    spec = json.loads((tok_dir / TOKENIZER_FILE).read_text())
    target = str((tok_dir / spec["file"]).resolve())
    if spec["type"] == "sentencepiece":
        return load_tokenizer({"type": "sentencepiece", "model_path": target})
    return load_tokenizer({"type": "hf", "name_or_path": target})
