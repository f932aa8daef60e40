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
    def load(self, path: Path, *, model, optimizer, scheduler, loader) -> dict:
        acc = self.acc
        meta = json.loads((path / STATE_FILE).read_text())
        restored = {k: meta[k] for k in ("step", "tokens", "skipped_steps", "wandb_id") if k in meta}
        saved, here = saved_layout(path / "accelerate"), run_layout(acc)
        if saved == here:
            acc.load_state(str(path / "accelerate"))
        else:
            load_across_layouts(path, saved, model, optimizer)
            warnings.warn(
                f"checkpoint {path} holds {LAYOUTS[saved]} and this run uses {LAYOUTS[here]}: the model weights and "
                f"the optimizer state are restored through full (unsharded) state dicts; the RNG states are not",
                stacklevel=2)
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
        loader_file = path / "loader" / f"rank{acc.process_index:05d}.pt"
        if meta.get("world_size") == acc.num_processes and loader_file.is_file():
            loader.load_state_dict(torch.load(loader_file, weights_only=False))
            return restored
        why = "the data stream restarts from its beginning with a new shard assignment"
        first = path / "loader" / "rank00000.pt"
        if hasattr(loader, "load_global_state") and first.is_file():  # data.shard=rows: one stream for every size
            try:
                loader.load_global_state(torch.load(first, weights_only=False))
                why = None
            except (ValueError, KeyError) as e:
                why = f"{why} ({e})"
        if why:
            warnings.warn(
                f"checkpoint {path} was written by {meta.get('world_size')} process(es), this run has "
                f"{acc.num_processes}: model, optimizer and schedule are restored, {why}", stacklevel=2)
        return restored


# How accelerate.save_state wrote a checkpoint's model and optimizer, and how this run's load_state reads them.
LAYOUTS = {"plain": "whole model and optimizer states (one process, or DDP)",
           "fsdp-sharded": "FSDP-sharded states (torch.distributed.checkpoint directories)",
           "fsdp-full": "FSDP full states (fsdp_state_dict_type FULL_STATE_DICT)"}
FSDP_MODEL_DIR, FSDP_OPTIMIZER_DIR = "pytorch_model_fsdp_0", "optimizer_0"


def saved_layout(acc_dir: Path) -> str:
    """Which of LAYOUTS accelerate.save_state wrote in acc_dir."""
    if (acc_dir / FSDP_MODEL_DIR).is_dir():
        return "fsdp-sharded"
    if (acc_dir / "pytorch_model_fsdp.bin").is_file():
        return "fsdp-full"
    if any((acc_dir / name).is_file() for name in ("model.safetensors", "pytorch_model.bin")):
        return "plain"
    raise FileNotFoundError(f"{acc_dir} holds no model state written by accelerate.save_state (the checkpoint is "
                            f"incomplete or not hilo's); resume from another checkpoint")


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
    saved = torch.load(acc_dir / "optimizer.bin", map_location="cpu", weights_only=False)
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


def load_checkpoint_tokenizer(path: str | os.PathLike):
    """The tokenizer saved with a checkpoint (or a run directory's newest checkpoint)."""
    from data import load_tokenizer

    tok_dir = resolve_checkpoint(path) / "tokenizer"
    spec = json.loads((tok_dir / TOKENIZER_FILE).read_text())
    target = str((tok_dir / spec["file"]).resolve())
    if spec["type"] == "sentencepiece":
        return load_tokenizer({"type": "sentencepiece", "model_path": target})
    return load_tokenizer({"type": "hf", "name_or_path": target})
