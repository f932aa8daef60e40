"""Causal depthwise short convolution (the short conv of the Mamba-2, Gated DeltaNet and HLA shells).

    y[b, t, c] = act(bias[c] + sum_{j=0}^{K-1} weight[c, K-1-j] * x[b, t-j, c])

x [B, T, C]; weight [C, K] (weight[:, K-1] multiplies the current token); bias [C] or None; act SiLU ("silu") or the
identity (None). Inputs before the first token come from initial_state [B, C, K-1] (column K-2 is the latest; zeros
when None). With cu_seqlens [N+1] (B == 1, packed documents) a tap that would reach into the previous document is
zero: every document starts from zeros, as if it ran alone. Returns y [B, T, C] in x's dtype; gradients flow to x,
weight, bias and initial_state.

Backends: "triton" (token-major kernels, no transposes, fp32 accumulation with the weights as given; a torch.library
custom op, so a compiled graph holds it as one node instead of breaking; the default on CUDA unless
HILO_SHORT_CONV=torch), "torch" (ATen's conv1d on the channel-major transpose, in x's dtype; the default elsewhere)
and "naive" (tap by tap in fp32: the oracle).
"""

import os

import torch

from hilo_kernels.common.precision import autocast_off
from hilo_kernels.common.validate import resolve_backend

from .conv1d import short_conv_conv1d
from .naive import short_conv_naive

ACTIVATIONS = ("silu", None)
# The backend CUDA tensors take when none is given: HILO_SHORT_CONV=torch goes back to ATen's conv1d (read at import).
CUDA_DEFAULT = os.environ.get("HILO_SHORT_CONV", "triton").strip() or "triton"
if CUDA_DEFAULT not in ("triton", "torch"):
    raise ValueError(f"HILO_SHORT_CONV={CUDA_DEFAULT!r}: expected 'triton' (the default) or 'torch'")

__all__ = ["short_conv"]


def _check_inputs(x, weight, bias, initial_state, cu_seqlens, activation) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim != 3 or not x.is_floating_point():
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"short_conv: x must be a floating-point tensor [B, T, C], got {got}")
    b, _, c = x.shape
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or weight.shape[0] != c or weight.shape[1] < 1:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"short_conv: weight must be [C={c}, K] with K >= 1, got {got}")
    k = weight.shape[1]
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (c,)):
        raise ValueError(f"short_conv: bias must be [C={c}] or None, got {tuple(bias.shape)}")
    if initial_state is not None and initial_state.shape != (b, c, k - 1):
        raise ValueError(f"short_conv: initial_state must be [B, C, K-1] = {(b, c, k - 1)}, got "
                         f"{tuple(initial_state.shape)}")
    if cu_seqlens is not None:
        if initial_state is not None:
            raise ValueError("short_conv takes either cu_seqlens (packed documents) or an initial_state, not both")
        if b != 1:
            raise ValueError(f"short_conv: cu_seqlens needs packed inputs with batch size 1, got {b}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"short_conv: activation must be 'silu' or None, got {activation!r}")
    for name, t in (("weight", weight), ("bias", bias), ("initial_state", initial_state), ("cu_seqlens", cu_seqlens)):
        if t is not None and t.device != x.device:
            raise ValueError(f"short_conv: {name} is on {t.device}, x on {x.device}")


@autocast_off
def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
    backend: str | None = None,
) -> torch.Tensor:
    """The causal depthwise conv of the module docstring; returns y [B, T, C] in x's dtype."""
    _check_inputs(x, weight, bias, initial_state, cu_seqlens, activation)
    # CUDA_DEFAULT was read at import: nothing here reads the environment (this runs inside compiled graphs)
    backend = CUDA_DEFAULT if backend is None and x.is_cuda else resolve_backend("short_conv", backend, x.device)
    silu = activation == "silu"
    if backend == "naive":
        return short_conv_naive(x, weight, bias, initial_state, cu_seqlens, silu)
    if backend == "torch":
        return short_conv_conv1d(x, weight, bias, initial_state, cu_seqlens, silu)
    from .triton import short_conv_triton

    return short_conv_triton(x, weight, bias, initial_state, cu_seqlens, silu)
