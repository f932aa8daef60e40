"""Log-linear Gated DeltaNet (`loglinear_delta_rule`, docs/kernels.md): the delta rule under a Fenwick level mask.

    o_t = scale * sum_{s <= t} lambda_t[l(t, s)] q_t^T P_{t<-s} beta_s k_s v_s^T,
    P_{t<-s} = prod_{r = s+1..t} exp(g_r) (I - beta_r k_r k_r^T),   l(t, s) = bit_length(t XOR s)

with t, s positions counted from 0 in each document (or from initial_state.tokens). With every lambda equal to 1 it
is hilo_kernels.delta_rule. The state is hilo_kernels.loglinear_attn.LogLinearState (per-level K x V states + token count).

Backends: "triton" (triton_fwd / triton_bwd: the per-chunk WY/UT pieces and the levels 0..6 block as batched torch
ops, the level scan, which carries every chunk level of a (sequence, head, V-block) in one program and moves them by
the chunk's Householder product, as a Triton forward and backward; the default on CUDA (GPU_DEFAULT); on CPU tensors
it runs under TRITON_INTERPRET=1),
"torch" (chunked: WY/UT per chunk, one dense masked block for levels 0..6 and one carried state per higher level, all
moved by the chunk's Householder product; exact, differentiable; the default off CUDA) and
"naive" (the binary-carry recurrence token by token: the oracle).
`loglinear_delta_rule_quadratic` (naive.py) is the O(T^2) definition used by the tests.
"""

import torch

from hilo_kernels.common.precision import autocast_off
from hilo_kernels.common.validate import MAX_DELTA_VALUE_DIM, check_recurrent_inputs, keyword_gates
from hilo_kernels.loglinear_attn import LogLinearState, final_state, resolve_loglinear_backend
from hilo_kernels.loglinear_attn.state import check_loglinear_inputs

from .chunk import loglinear_delta_rule_chunk
from .naive import loglinear_delta_rule_naive, loglinear_delta_rule_quadratic
from .step import loglinear_delta_rule_step

# CUDA tensors take the Triton backend: checked in bf16 on the H200 (Triton 3.6: every gradient, varlen, small and
# uneven heads) and 2.6x / 24x faster than the chunked torch path at T = 4K / 16K (docs/performance.md).
GPU_DEFAULT = "triton"

__all__ = ["LogLinearState", "loglinear_delta_rule", "loglinear_delta_rule_quadratic", "loglinear_delta_rule_step"]


@keyword_gates("beta", "g", "level_scales")
@autocast_off
def loglinear_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    level_scales: torch.Tensor,
    scale: float | None = None,
    initial_state: LogLinearState | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, LogLinearState | None]:
    """Log-linear gated delta rule; returns (o [B, T, H, V] in v's dtype, LogLinearState or None).

    q, k [B, T, H, K] with K <= 256, v [B, T, H, V] with V <= 512 (hilo_kernels.common.validate.MAX_DELTA_VALUE_DIM;
    bf16 on the GPU at V > 256 is not yet checked) (one dtype: fp32/fp16/bf16); beta [B, T, H]; g [B, T, H] fp32 log decays
    (<= 0) or None; level_scales [B, T, H, L] with L >= bit_length(last position) + 1 per sequence; scale
    multiplies q (default K ** -0.5). initial_state / final state: LogLinearState(levels [N, H, L, K, V] fp32,
    tokens [N] int64), exactly the recurrent form's per-level states after `tokens` tokens (see
    hilo_kernels.loglinear_attn.state), so forward(a + b) == forward(b, initial_state=forward(a).final).
    cu_seqlens [N+1] packs N documents in B == 1 (positions restart in each). Gradients flow to q, k, v, beta, g,
    level_scales and initial_state.levels. backend: "triton", "torch", "naive" or None (GPU_DEFAULT on CUDA,
    torch otherwise).
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"loglinear_delta_rule: q must be a torch.Tensor, got {type(q).__name__}")
    if not isinstance(beta, torch.Tensor):
        raise TypeError(f"loglinear_delta_rule: beta must be a torch.Tensor [B, T, H], got {type(beta).__name__}")
    if backend is None and q.device.type == "cuda":
        backend = GPU_DEFAULT
    backend = resolve_loglinear_backend("loglinear_delta_rule", backend, q.device)
    n = check_recurrent_inputs("loglinear_delta_rule", q, k, v, g=g, beta=beta, cu_seqlens=cu_seqlens,
                               backend=backend, max_dv=MAX_DELTA_VALUE_DIM)
    starts = check_loglinear_inputs("loglinear_delta_rule", q, v, level_scales, initial_state, n, cu_seqlens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    scale = float(scale)
    if backend == "triton":
        from .triton_bwd import loglinear_delta_rule_triton as fn
        if q.is_cuda and v.shape[-1] < PADDED_VALUE_DIM:
            fn = loglinear_delta_rule_triton_padded
    else:
        fn = loglinear_delta_rule_naive if backend == "naive" else loglinear_delta_rule_chunk
    o, levels = fn(q, k, v, beta, g, level_scales, scale, initial_state, output_final_state, cu_seqlens, starts)
    return o, final_state(levels, q, cu_seqlens, starts) if output_final_state else None


# On the H200 (Triton 3.6, bf16) K = 128 with V = 16 hit an illegal memory access in the level scans: a V that
# narrow leaves a one-state [K, 16] tile, below the 32 stacked columns that scan_launches keeps where V allows (at
# K = 256 the same tile faulted). V >= 32, and V = 16 at K <= 64, ran. CUDA heads narrower than PADDED_VALUE_DIM run
# with their values zero-padded to it.
PADDED_VALUE_DIM = 32


def loglinear_delta_rule_triton_padded(q, k, v, beta, g, level_scales, scale, initial_state, output_final_state,
                                       cu_seqlens, starts):
    """The Triton backend on values zero-padded to PADDED_VALUE_DIM columns, then sliced back: exact, because each
    value column of the state evolves on its own (the transitions act on the key side), so zero value columns keep
    zero state columns and only fill output columns that are dropped."""
    import torch.nn.functional as F

    from .triton_bwd import loglinear_delta_rule_triton

    dv = v.shape[-1]
    pad = PADDED_VALUE_DIM - dv
    prior = None if initial_state is None else initial_state._replace(levels=F.pad(initial_state.levels, (0, pad)))
    o, levels = loglinear_delta_rule_triton(q, k, F.pad(v, (0, pad)), beta, g, level_scales, scale, prior,
                                            output_final_state, cu_seqlens, starts)
    return o[..., :dv], (None if levels is None else levels[..., :dv])
