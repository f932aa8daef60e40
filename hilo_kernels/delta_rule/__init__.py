"""Gated DeltaNet (`delta_rule`, docs/kernels.md): S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,
o_t = scale * q_t^T S_t, per head, over [B, T, H, D] tensors.

Backends: "triton" (chunked WY/UT kernels, forward and backward; on CPU tensors only under TRITON_INTERPRET=1),
"torch" (hilo_kernels.delta_rule.chunk: chunked PyTorch, differentiable by autograd, the CPU path), "naive" (the token
recurrence in fp32: the test oracle). Default: triton on CUDA, torch otherwise.
"""

import torch

from hilo_kernels.common.precision import autocast_off
from hilo_kernels.common.validate import (
    BACKENDS,
    MAX_DELTA_VALUE_DIM,
    check_recurrent_inputs,
    keyword_gates,
    resolve_backend,
)

from .chunk import delta_rule_chunk
from .naive import delta_rule_naive
from .step import delta_rule_step

__all__ = ["BACKENDS", "delta_rule", "delta_rule_step"]


@keyword_gates("beta", "g")
@autocast_off
def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
):
    """Gated delta rule over a sequence; returns (o [B, T, H, V] in v's dtype, final_state [N, H, K, V] fp32 or
    None).

    q, k [B, T, H, K] with K <= 256; v [B, T, H, V] with V <= 512 (hilo_kernels.common.validate.MAX_DELTA_VALUE_DIM:
    the Triton kernels tile V, so Gated DeltaNet's K = 256, V = 512 heads can run in one call; bf16 on the GPU
    at V > 256 is not yet checked); beta [B, T, H] (the
    write strength, usually sigmoid outputs); g [B, T, H] natural-log decay (<= 0), or None for no decay; scale
    multiplies q (default K ** -0.5). The operator is exact for any k (the layer L2-normalises k; the op does not
    assume it). initial_state [N, H, K, V] (fp32) with N = B, or N = len(cu_seqlens) - 1 for packed documents
    (cu_seqlens int tensor [N+1], B == 1: no state or decay crosses a boundary). Gradients flow to q, k, v, beta, g
    and initial_state. A CPU cu_seqlens is validated on the host; a CUDA one by a device-side assertion (no host
    synchronisation).
    backend: "triton", "torch", "naive" or None (triton on CUDA, torch otherwise).
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"delta_rule: q must be a torch.Tensor, got {type(q).__name__}")
    backend = resolve_backend("delta_rule", backend, q.device)
    if not isinstance(beta, torch.Tensor):
        raise TypeError(f"delta_rule: beta must be a torch.Tensor [B, T, H], got {type(beta).__name__}")
    check_recurrent_inputs("delta_rule", q, k, v, g=g, beta=beta, initial_state=initial_state,
                           cu_seqlens=cu_seqlens, backend=backend, max_dv=MAX_DELTA_VALUE_DIM)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if backend in ("torch", "naive"):
        bounds = None if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
        fn = delta_rule_chunk if backend == "torch" else delta_rule_naive
        return fn(q, k, v, beta, g, scale, initial_state, output_final_state, bounds)
    from .triton_bwd import delta_rule_triton

    if q.is_cuda:
        min_k, min_v = PADDED_HEAD_DIMS
        if q.shape[-1] < min_k or v.shape[-1] < min_v:
            return delta_rule_triton_padded(q, k, v, beta, g, scale, initial_state, output_final_state, cu_seqlens)
    return delta_rule_triton(q, k, v, beta, g, scale, initial_state, output_final_state, cu_seqlens)


# On the H200 (Triton 3.6, bf16) the kernels hit an illegal memory access at K = V = 16 and at K = 64, V = 32;
# K = 32, V = 64 and every V >= 60 were exact there. CUDA heads narrower than PADDED_HEAD_DIMS (K, V) run zero-padded
# to it.
PADDED_HEAD_DIMS = (32, 64)


def delta_rule_triton_padded(q, k, v, beta, g, scale, initial_state, output_final_state, cu_seqlens):
    """The Triton delta rule on heads zero-padded to at least PADDED_HEAD_DIMS (K, V), then sliced back: exact,
    because zero key columns never touch the state (k^T S and k k^T ignore them, so padded state rows stay zero)
    and zero value columns only fill state and output columns that are dropped. scale must already be resolved."""
    import torch.nn.functional as F

    from .triton_bwd import delta_rule_triton

    dk, dv = q.shape[-1], v.shape[-1]
    min_k, min_v = PADDED_HEAD_DIMS
    pk, pv = max(dk, min_k) - dk, max(dv, min_v) - dv
    h0 = None if initial_state is None else F.pad(initial_state, (0, pv, 0, pk))
    o, final = delta_rule_triton(F.pad(q, (0, pk)), F.pad(k, (0, pk)), F.pad(v, (0, pv)), beta, g, scale, h0,
                                 output_final_state, cu_seqlens)
    return o[..., :dv], (None if final is None else final[..., :dk, :dv])
