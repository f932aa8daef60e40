"""Linear attention with a scalar per-head log decay: Mamba-2 SSD / simple GLA (`linear_attn`, docs/kernels.md).

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,    o_t = scale * q_t^T S_t      (per head, S is K x V)

Backends: "triton" (chunked Triton kernels, forward and backward; the default on CUDA; on CPU tensors it
runs under TRITON_INTERPRET=1), "torch" (chunked PyTorch through autograd, exact; the default elsewhere),
"naive" (the token recurrence: the oracle). None of them synchronises with the host for cu_seqlens.
"""

import torch

from hilo_kernels.common.precision import autocast_off
from hilo_kernels.common.validate import check_recurrent_inputs, keyword_gates, resolve_backend

from .chunk import linear_attn_chunk
from .naive import linear_attn_naive
from .step import linear_attn_step

__all__ = ["linear_attn", "linear_attn_step"]


@keyword_gates("g")
@autocast_off
def linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated linear attention; returns (o [B, T, H, V] in q's dtype, final_state [N, H, K, V] fp32 or None).

    q, k [B, T, H, K] and v [B, T, H, V] share a dtype (fp32, fp16 or bf16); g [B, T, H] fp32 natural-log
    decays (<= 0), None for no decay; scale multiplies q (default K ** -0.5); initial_state [N, H, K, V] fp32
    with N = B, or N = len(cu_seqlens) - 1 for packed documents (B == 1; no state crosses a boundary).
    Gradients flow to q, k, v, g and initial_state. backend: "triton", "torch", "naive" or None (triton on
    CUDA, torch otherwise).

    Grouped q and k: [B, T, G, K] with G dividing H, head h reading group h // (H / G) (Mamba-2's n_groups: B and
    C shared by the heads of a group). The same as repeating them to every head, but the Triton kernels read each
    head's q and k from its group in place (no H / G copies, forward or backward) and the backward sums a group's
    per-head dq, dk in one fp32-accumulating reduction.
    """
    backend = resolve_backend("linear_attn", backend, q.device if isinstance(q, torch.Tensor) else
                              torch.device("cpu"))
    check_recurrent_inputs("linear_attn", q, k, v, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens,
                           backend=backend, grouped=True)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    scale = float(scale)
    if backend != "triton" and q.shape[2] != v.shape[2]:  # autograd sums the repeated heads' gradients
        q, k = (x.repeat_interleave(v.shape[2] // q.shape[2], dim=2) for x in (q, k))
    if backend == "naive":
        return linear_attn_naive(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)
    if backend == "torch":
        return linear_attn_chunk(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)
    from .triton_bwd import linear_attn_triton

    return linear_attn_triton(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)
