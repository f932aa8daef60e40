"""Normalization layers."""

import torch
import torch.nn.functional as F
from torch import nn


def _rms_norm(x, weight, eps):
    """RMSNorm's math: (y in x's dtype, fp32 per-row rstd)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(x.dtype), rstd


def _gated_rms_norm(x, gate, weight, eps, norm_before_gate, group_size):
    """GatedRMSNorm's math: (y in x's dtype, per-(row, group) rstd in the compute dtype)."""
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for double-precision checks
    xf, gf = x.to(acc), gate.to(acc)
    u = xf if norm_before_gate else xf * F.silu(gf)
    grouped = u.unflatten(-1, (-1, group_size))
    rstd = torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    y = (grouped * rstd).flatten(-2) * weight.to(acc)
    if norm_before_gate:
        y = y * F.silu(gf)
    return y.to(x.dtype), rstd


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm's math (fp32) with a hand-written backward that keeps only x (in its dtype) and the per-row rstd:
    autograd through the formula would also keep the fp32 normalized x, one more fp32 copy of the layer input.
    Eager only: torch 2.11's dynamo traced this Function's backward into wrong gradients on CUDA (x and weight,
    relative error 1.0, with aot_eager too), so a compiled block runs the formula through autograd and inductor
    plans what it keeps."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        xf, dyf, w = x.float(), dy.float(), weight.float()
        dweight = (dyf * (xf * rstd)).reshape(-1, w.shape[0]).sum(0)
        # y = w * x * rstd  =>  dx = rstd * a - x * rstd^3 * mean(a * x), with a = dy * w
        a = dyf * w
        dx = rstd * a - xf * rstd.pow(3) * (a * xf).mean(-1, keepdim=True)
        return dx.to(x.dtype), dweight.to(weight.dtype), None


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and returned in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # see _RMSNormFn
            return _rms_norm(x, self.weight, self.eps)[0]
        return _RMSNormFn.apply(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(h), h) with h = residual + x: a pre-norm block adding a branch's output x to the residual stream
        and normalizing the sum for the next branch."""
        hidden = residual + x
        return self(hidden), hidden


class _GatedRMSNormFn(torch.autograd.Function):
    """GatedRMSNorm's math with a hand-written backward that keeps only x, gate (in their dtype) and the
    per-group rstd: autograd through the fp32 formula would keep about five fp32 copies of x per layer."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps, norm_before_gate, group_size):
        y, rstd = _gated_rms_norm(x, gate, weight, eps, norm_before_gate, group_size)
        ctx.save_for_backward(x, gate, weight, rstd)
        ctx.norm_before_gate, ctx.group_size = norm_before_gate, group_size
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate, weight, rstd = ctx.saved_tensors
        gs = ctx.group_size
        acc = rstd.dtype
        xf, gf, dyf, w = x.to(acc), gate.to(acc), dy.to(acc), weight.to(acc)
        sig = torch.sigmoid(gf)
        silu = gf * sig
        dsilu = sig * (1 + gf * (1 - sig))
        u = xf if ctx.norm_before_gate else xf * silu
        normed = (u.unflatten(-1, (-1, gs)) * rstd).flatten(-2)
        if ctx.norm_before_gate:
            dgate = dyf * normed * w * dsilu
            dyf = dyf * silu
        # y = w * u * rstd  =>  du = rstd * a - u * rstd^3 * mean(a * u) per group, with a = dy * w
        dweight = (dyf * normed).reshape(-1, w.shape[0]).sum(0)
        a = (dyf * w).unflatten(-1, (-1, gs))
        ug = u.unflatten(-1, (-1, gs))
        du = (rstd * a - ug * rstd.pow(3) * (a * ug).mean(-1, keepdim=True)).flatten(-2)
        if ctx.norm_before_gate:
            dx = du
        else:
            dx = du * silu
            dgate = du * xf * dsilu
        return dx.to(x.dtype), dgate.to(gate.dtype), dweight.to(weight.dtype), None, None, None


class GatedRMSNorm(RMSNorm):
    """RMSNorm with a SiLU output gate, over the last dim of x (size dim), in fp32 (fp64 for fp64 inputs),
    returned in x's dtype.

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
        if gate.shape != x.shape:
            raise ValueError(f"GatedRMSNorm: gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
        if torch.compiler.is_compiling():  # see _RMSNormFn
            return _gated_rms_norm(x, gate, self.weight, self.eps, self.norm_before_gate, self.group_size)[0]
        return _GatedRMSNormFn.apply(x, gate, self.weight, self.eps, self.norm_before_gate, self.group_size)
