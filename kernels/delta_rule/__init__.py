"""Gated DeltaNet (SPEC §2, `delta_rule`): S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,
o_t = scale * q_t^T S_t, per head, over [B, T, H, D] tensors.

Backends: "triton" (chunked WY/UT kernels, forward and backward; on CPU tensors only under TRITON_INTERPRET=1),
"torch" (kernels.delta_rule.chunk: chunked PyTorch, differentiable by autograd, the CPU path), "naive" (the token
recurrence in fp32: the test oracle). Default: triton on CUDA, torch otherwise.
"""

import os

import torch

from .chunk import delta_rule_chunk
from .naive import delta_rule_naive
from .step import delta_rule_step

BACKENDS = ("triton", "torch", "naive")
# float64 is accepted by the torch and naive backends (double-precision references), not by triton.
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

__all__ = ["delta_rule", "delta_rule_step", "BACKENDS"]


def _check_inputs(q, k, v, beta, g, initial_state, cu_seqlens):
    """Raise a clear error for anything that is not the documented contract; return N (number of sequences)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"delta_rule: {name} must be a torch.Tensor, got {type(x).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"delta_rule: {name} must be 4-D [B, T, H, D], got shape {tuple(x.shape)}")
        if x.dtype not in _DTYPES:
            raise TypeError(f"delta_rule: {name} must be float32, float16, bfloat16 (or float64), got {x.dtype}")
    if k.shape != q.shape:
        raise ValueError(f"delta_rule: k must have q's shape [B, T, H, K] = {tuple(q.shape)}, got {tuple(k.shape)}")
    b, t, h, dk = q.shape
    if v.shape[:3] != (b, t, h):
        raise ValueError(f"delta_rule: v must be [B={b}, T={t}, H={h}, V], got {tuple(v.shape)}")
    dv = v.shape[3]
    if dk > 256 or dv > 256 or dk == 0 or dv == 0:
        raise ValueError(f"delta_rule: head dims must be in 1..256, got K={dk}, V={dv}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"delta_rule: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if beta.shape != (b, t, h) or beta.dtype not in _DTYPES:
        raise ValueError(f"delta_rule: beta must be a float tensor [B, T, H] = {(b, t, h)}, got "
                         f"{tuple(beta.shape)} {beta.dtype}")
    tensors = [("q", q), ("k", k), ("v", v), ("beta", beta)]
    if g is not None:
        if not isinstance(g, torch.Tensor) or g.shape != (b, t, h) or g.dtype not in _DTYPES:
            raise ValueError(f"delta_rule: g must be None or a float tensor [B, T, H] = {(b, t, h)} (fp32 log decay "
                             f"<= 0), got {tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__}")
        tensors.append(("g", g))
    n = b
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.ndim != 1 or cu_seqlens.dtype not in (
            torch.int32, torch.int64
        ):
            raise TypeError("delta_rule: cu_seqlens must be a 1-D int32/int64 tensor [N+1] of document boundaries")
        if b != 1:
            raise ValueError(f"delta_rule: cu_seqlens needs packed inputs with B == 1, got B={b}")
        if cu_seqlens.numel() < 2:
            raise ValueError("delta_rule: cu_seqlens must hold at least two boundaries [0, ..., T]")
        n = cu_seqlens.numel() - 1
        if cu_seqlens.device.type == "cpu":
            # Values are checked only for CPU tensors: reading a CUDA tensor would synchronise with the host.
            bounds = cu_seqlens.tolist()
            if bounds[0] != 0 or bounds[-1] != t or any(x > y for x, y in zip(bounds[:-1], bounds[1:])):
                raise ValueError(f"delta_rule: cu_seqlens must start at 0, be non-decreasing and end at T={t}, got "
                                 f"{bounds}")
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or initial_state.shape != (n, h, dk, dv):
            shape = tuple(initial_state.shape) if isinstance(initial_state, torch.Tensor) else type(initial_state)
            raise ValueError(f"delta_rule: initial_state must be [N, H, K, V] = {(n, h, dk, dv)}, got {shape}")
        if initial_state.dtype not in _DTYPES:
            raise TypeError(f"delta_rule: initial_state must be a float tensor (fp32), got {initial_state.dtype}")
        tensors.append(("initial_state", initial_state))
    for name, x in tensors:
        if x.device != q.device:
            raise ValueError(f"delta_rule: {name} is on {x.device} but q is on {q.device}; all inputs must share "
                             f"one device")
    return n


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
):
    """Gated delta rule over a sequence; returns (o [B, T, H, V] in v's dtype, final_state [N, H, K, V] fp32 or
    None).

    q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H] (the write strength, usually sigmoid outputs); g [B, T, H]
    natural-log decay (<= 0), or None for no decay; scale multiplies q (default K ** -0.5). The operator is exact
    for any k (the layer L2-normalises k; the op does not assume it). initial_state [N, H, K, V] (fp32) with N = B,
    or N = len(cu_seqlens) - 1 for packed documents (cu_seqlens int tensor [N+1], B == 1: no state or decay crosses
    a boundary). Gradients flow to q, k, v, beta, g and initial_state. cu_seqlens values are validated only when
    the tensor is on the CPU (checking a CUDA tensor would synchronise with the host).
    backend: "triton", "torch", "naive" or None (triton on CUDA, torch otherwise).
    """
    _check_inputs(q, k, v, beta, g, initial_state, cu_seqlens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if backend is None:
        backend = "triton" if q.is_cuda else "torch"
    if backend in ("torch", "naive"):
        bounds = None if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
        fn = delta_rule_chunk if backend == "torch" else delta_rule_naive
        return fn(q, k, v, beta, g, scale, initial_state, output_final_state, bounds)
    if backend == "triton":
        if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("delta_rule: backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
                               "kernels is imported; use backend='torch' on CPU")
        from .triton_bwd import delta_rule_triton

        return delta_rule_triton(q, k, v, beta, g, scale, initial_state, output_final_state, cu_seqlens)
    raise ValueError(f"delta_rule: unknown backend {backend!r}; expected one of {BACKENDS} or None")
