"""Normalization layers."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and returned in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """RMSNorm with a SiLU output gate, over the last dim of x (size dim), in fp32, returned in x's dtype.

    norm_before_gate=False (Mamba-2): y = RMSNorm(x * SiLU(gate)).
    norm_before_gate=True (Gated DeltaNet): y = RMSNorm(x) * SiLU(gate).
    gate has x's shape. group_size (a divisor of dim; None = dim) normalizes each run of group_size channels on
    its own (Mamba-2 with n_groups > 1). The weight [dim] is initialised to ones like RMSNorm's.
    """

    def __init__(self, dim: int, eps: float = 1e-6, norm_before_gate: bool = False, group_size: int | None = None):
        super().__init__(dim, eps)
        group_size = dim if group_size is None else group_size
        if dim % group_size != 0:
            raise ValueError(f"group_size ({group_size}) must divide dim ({dim})")
        self.norm_before_gate = norm_before_gate
        self.group_size = group_size

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf, gf = x.float(), gate.float()
        if not self.norm_before_gate:
            xf = xf * torch.nn.functional.silu(gf)
        grouped = xf.unflatten(-1, (-1, self.group_size))
        y = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        y = y * self.weight.float()
        if self.norm_before_gate:
            y = y * torch.nn.functional.silu(gf)
        return y.to(x.dtype)
