"""Log-linear attention (`loglinear_attn`, docs/kernels.md): linear attention whose causal mask is a Fenwick hierarchy.

    o_t = scale * sum_{s <= t} lambda_t[l(t, s)] exp(G_t - G_s) (q_t . k_s) v_s,   l(t, s) = bit_length(t XOR s)

with G_t = sum_{r <= t} g_r and t, s positions counted from 0 in each document (or from initial_state.tokens).
With every lambda equal to 1 it is hilo_kernels.linear_attn.

Backends: "triton" (triton_fwd / triton_bwd / triton_nodes: an intra-chunk kernel for levels 0..6, and the chunk
levels either as a tree of node states built and read by every chunk in parallel (form "nodes", the default) or as
one level scan carrying every chunk-level state of a (sequence, head, V-block) chunk to chunk (form "scan");
forward and backward; the default on CUDA, on CPU tensors it runs under TRITON_INTERPRET=1), "torch" (hilo_kernels.loglinear_attn.chunk: chunks of 64 aligned
to absolute positions, one dense masked block per chunk for levels 0..6 and one carried state per higher level;
exact, differentiable by autograd; the default elsewhere) and "naive" (the binary-carry recurrence token by token:
the oracle). `loglinear_attn_quadratic` (naive.py) is the O(T^2) definition, used by the tests.
"""

import torch

from hilo_kernels.common.precision import autocast_off
from hilo_kernels.common.validate import check_recurrent_inputs, keyword_gates, resolve_backend

from .chunk import loglinear_chunk, prepare_linear
from .naive import loglinear_attn_naive, loglinear_attn_quadratic
from .state import LogLinearState, check_loglinear_inputs, num_levels
from .step import loglinear_attn_step

BACKENDS = ("triton", "torch", "naive")

__all__ = ["BACKENDS", "LogLinearState", "final_state", "loglinear_attn", "loglinear_attn_quadratic", "loglinear_attn_step",
           "num_levels", "resolve_loglinear_backend"]


def resolve_loglinear_backend(op: str, backend: str | None, device: torch.device) -> str:
    """None -> "triton" on CUDA, "torch" elsewhere; "triton" on CPU tensors needs TRITON_INTERPRET=1 (set before
    kernels is imported); an unknown name raises (hilo_kernels.common.validate.resolve_backend)."""
    return resolve_backend(op, backend, device)


@keyword_gates("g", "level_scales")
@autocast_off
def loglinear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor | None,
    level_scales: torch.Tensor,
    scale: float | None = None,
    initial_state: LogLinearState | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, LogLinearState | None]:
    """Log-linear attention; returns (o [B, T, H, V] in q's dtype, LogLinearState or None).

    q, k [B, T, H, K], v [B, T, H, V] (fp32/fp16/bf16, one dtype); g [B, T, H] fp32 natural-log decays (<= 0) or
    None; level_scales [B, T, H, L] (lambda_t[l]), L >= bit_length(last position) + 1 for every sequence (a
    ValueError says how many are needed); scale multiplies q (default K ** -0.5).
    initial_state: LogLinearState(levels [N, H, L, K, V] fp32, tokens [N] int64), the per-level states of N
    sequences that already consumed `tokens` tokens (see hilo_kernels.loglinear_attn.state); the new tokens then sit at
    positions tokens, tokens + 1, ... . The final state has the same structure (tokens + this call's lengths) and
    equals the recurrent form's state, so forward(a + b) == forward(b, initial_state=forward(a).final).
    cu_seqlens [N+1] packs N documents in B == 1; positions restart at 0 (or at tokens[n]) in each.
    Gradients flow to q, k, v, g, level_scales and initial_state.levels. backend: "triton", "torch", "naive" or
    None (triton on CUDA, torch otherwise).
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"loglinear_attn: q must be a torch.Tensor, got {type(q).__name__}")
    backend = resolve_loglinear_backend("loglinear_attn", backend, q.device)
    n = check_recurrent_inputs("loglinear_attn", q, k, v, g=g, cu_seqlens=cu_seqlens, backend=backend)
    starts = check_loglinear_inputs("loglinear_attn", q, v, level_scales, initial_state, n, cu_seqlens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    scale = float(scale)
    if backend == "naive":
        o, levels = loglinear_attn_naive(q, k, v, g, level_scales, scale, initial_state, output_final_state,
                                         cu_seqlens, starts)
    elif backend == "triton":
        from .triton_bwd import loglinear_attn_triton

        o, levels = loglinear_attn_triton(q, k, v, g, level_scales, scale, initial_state, output_final_state,
                                          cu_seqlens, starts)
    else:
        o, levels = loglinear_chunk(q, k, v, None, g, level_scales, scale, initial_state, output_final_state,
                                    cu_seqlens, starts, prepare_linear, q.dtype)
    return o, final_state(levels, q, cu_seqlens, starts) if output_final_state else None


def final_state(levels: torch.Tensor, q: torch.Tensor, cu_seqlens: torch.Tensor | None,
                starts: list[int]) -> LogLinearState:
    """Wrap final levels with each sequence's token count (start + length)."""
    b, t = q.shape[:2]
    if cu_seqlens is None:
        lengths = torch.full((b,), t, dtype=torch.int64)
    else:
        cu = cu_seqlens.detach().to("cpu", torch.int64)
        lengths = cu[1:] - cu[:-1]
    tokens = (torch.tensor(starts, dtype=torch.int64) + lengths).to(q.device)
    out = levels.to(torch.float32) if levels.dtype != torch.float64 else levels
    return LogLinearState(out, tokens)
