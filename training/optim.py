"""AdamW with no-decay groups, and the learning-rate schedules (warmup + cosine, WSD, constant)."""
from __future__ import annotations

import math

import torch


def split_decay_groups(model: torch.nn.Module, no_decay_names) -> tuple[list, list]:
    """Parameters that get weight decay, and those that do not.

    No decay for: tensors with fewer than 2 dims (norm weights, biases, A_log, dt_bias, D), any parameter whose
    name contains an entry of `no_decay_names` (embeddings, norms), and any parameter flagged
    `param._no_weight_decay = True` by its module (the log-linear level parameter L, for example)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        skip = p.ndim < 2 or getattr(p, "_no_weight_decay", False) or any(s in name for s in no_decay_names)
        (no_decay if skip else decay).append(p)
    return decay, no_decay


def freeze_parameters(model: torch.nn.Module, patterns) -> list[str]:
    """Keep the parameters whose names match any of `patterns` (fnmatch globs on the full name, e.g. '*.mixer.L')
    at their current values: requires_grad is cleared, so they get no gradient, no update and no share of the
    clipped norm. Returns the frozen names. A pattern that matches no parameter is an error (a typo would otherwise
    train everything), as is freezing every parameter."""
    import difflib
    import fnmatch

    patterns = list(patterns or [])
    if not patterns:
        return []
    names = [name for name, _ in model.named_parameters()]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            near = difflib.get_close_matches(pattern.replace("*", ""), names, n=3, cutoff=0.0)
            raise ValueError(f"optim.frozen: {pattern!r} matches no parameter; patterns are globs on full names, "
                             f"the nearest being {', '.join(map(repr, near))}")
    frozen = []
    for name, p in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            p.requires_grad_(False)
            frozen.append(name)
    if len(frozen) == len(names):
        raise ValueError(f"optim.frozen={patterns} freezes every parameter: nothing is left to train")
    return frozen


def build_optimizer(model: torch.nn.Module, optim_cfg, on_cuda: bool) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (optim.frozen's are frozen first), in a decay and a no-decay group."""
    if optim_cfg.name != "adamw":
        raise ValueError(f"optim.name={optim_cfg.name!r} is not supported; the available optimizer is adamw")
    freeze_parameters(model, optim_cfg.get("frozen"))
    decay, no_decay = split_decay_groups(model, list(optim_cfg.no_decay))
    groups = [{"params": decay, "weight_decay": float(optim_cfg.weight_decay)},
              {"params": no_decay, "weight_decay": 0.0}]
    fused = optim_cfg.get("fused", "auto")
    fused = on_cuda if fused == "auto" else bool(fused)
    return torch.optim.AdamW(groups, lr=float(optim_cfg.lr), betas=tuple(optim_cfg.betas),
                             eps=float(optim_cfg.eps), fused=fused or None)


def lr_multiplier(step: int, *, total_steps: int, schedule: str, warmup_steps: int, min_lr_ratio: float,
                  decay_fraction: float) -> float:
    """The factor on the peak lr before optimizer step `step` (0-based).

    Linear warmup over warmup_steps, then: cosine from 1 to min_lr_ratio at total_steps; or WSD (warmup-stable-
    decay: flat, then linear to min_lr_ratio over the last decay_fraction of the steps); or constant."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        span = max(total_steps - warmup_steps, 1)
        progress = min(max(step - warmup_steps, 0) / span, 1.0)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "wsd":
        decay_steps = max(round(decay_fraction * total_steps), 1)
        decay_start = max(total_steps - decay_steps, warmup_steps)
        if step < decay_start:
            return 1.0
        progress = min((step - decay_start) / max(total_steps - decay_start, 1), 1.0)
        return 1.0 - (1 - min_lr_ratio) * progress
    raise ValueError(f"optim.schedule={schedule!r}: expected cosine, wsd or constant")


def build_lr_schedule(optimizer: torch.optim.Optimizer, optim_cfg, total_steps: int):
    """A LambdaLR stepped once per optimizer step by the loop itself (not through accelerate.prepare, which
    would step it once per process)."""
    kwargs = {"total_steps": total_steps, "schedule": str(optim_cfg.schedule),
              "warmup_steps": int(optim_cfg.warmup_steps), "min_lr_ratio": float(optim_cfg.min_lr_ratio),
              "decay_fraction": float(optim_cfg.decay_fraction)}
    lr_multiplier(0, **kwargs)  # fail now on a bad schedule name
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, **kwargs))


def local_grad_norm(grad_norm, device: torch.device) -> torch.Tensor:
    """The total gradient norm from clip_grad_norm_ as a plain tensor on device. Under FSDP2 the gradients are
    DTensors and so is the norm torch returns; a DTensor cannot go through a process-group all_reduce (no sharding
    strategy for c10d.allreduce_: the H200 FSDP run of 2026-11-29 died there), so it is made whole first."""
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    return torch.as_tensor(grad_norm, device=device)
