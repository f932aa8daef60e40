"""Decay-gate parameters shared by the Mamba-2 and Gated DeltaNet shells, and their initialisation.

Both shells compute a per-head log-decay g = -exp(A_log) * softplus(raw + dt_bias) <= 0 (Mamba-2's raw is the dt
projection, GDN's the a projection). A_log, dt_bias (and Mamba-2's D) are excluded from weight decay: they are
flagged `_no_weight_decay = True`, which training.optim.split_decay_groups honours.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


def no_weight_decay(param: nn.Parameter) -> nn.Parameter:
    """Flag param so the optimizer puts it in the no-decay group; returns it."""
    param._no_weight_decay = True
    return param


def a_log_init(num_heads: int, a_min: float = 1.0, a_max: float = 16.0) -> nn.Parameter:
    """A_log [num_heads] with A = exp(A_log) ~ Uniform[a_min, a_max] (so -exp(A_log) lies in [-a_max, -a_min])."""
    if not 0 < a_min <= a_max:
        raise ValueError(f"A init range must satisfy 0 < a_min <= a_max, got [{a_min}, {a_max}]")
    a = torch.empty(num_heads, dtype=torch.float32).uniform_(a_min, a_max)
    return no_weight_decay(nn.Parameter(torch.log(a)))


def dt_bias_init(num_heads: int, dt_min: float = 1e-3, dt_max: float = 1e-1) -> nn.Parameter:
    """dt_bias [num_heads] with softplus(dt_bias) log-uniform in [dt_min, dt_max] (the inverse softplus of a
    log-uniform sample: dt + log(1 - exp(-dt)))."""
    if not 0 < dt_min <= dt_max:
        raise ValueError(f"dt init range must satisfy 0 < dt_min <= dt_max, got [{dt_min}, {dt_max}]")
    u = torch.rand(num_heads, dtype=torch.float32)
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    return no_weight_decay(nn.Parameter(dt + torch.log(-torch.expm1(-dt))))


def log_decay(a_log: torch.Tensor, raw: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dt, g) in fp32 from raw [..., H]: dt = softplus(raw + dt_bias), g = -exp(A_log) * dt (natural-log decay)."""
    dt = F.softplus(raw.float() + dt_bias.float())
    return dt, -torch.exp(a_log.float()) * dt
