"""The HLA family as exact compositions of linear attention passes (docs/kernels.md).

With LA(Q, K, V; p g) = hilo_kernels.linear_attn with decay exp(p g) and HLA's `scale` on Q (each pass takes it as
linear_attn's own scale: every pass is linear in Q):

    hla2 "d1"   K~ = LA(Q, K, K; 2g),  o = LA(Q, K~, V; g)
    hla2 "d2"   K~ = LA(Q, K, K; g),   o = LA(Q, K~, V; 2g)
    ahla        V~ = LA(Q, K, V; g),   o = LA(Q, K, V~; g)
    hla3        K~ = LA(Q, K, K; 2g),  V~ = LA(Q, K, V; g),  o = LA(Q, K~, V~; g)

(no decay: every pass undecayed). The LA(Q, K, K) passes use the keys as values (V dim = K dim). Each pass
carries its own state; together they are the op's state (hilo_kernels.hla.state). With normalize=True a column of
ones is appended to V: every pass is linear in its values, so the last output column is the same operator on
ones, the denominator, and o = numerator / signed_clamp(denominator). cu_seqlens goes to every pass unchanged.
Passes run in float32 (float64 for float64 inputs) so the intermediates K~, V~, which grow with t, keep full
precision; o is returned in q's dtype. Gradients are autograd through the passes of the chosen linear_attn backend
("torch": chunked PyTorch; "triton": linear_attn's Triton kernels, forward and backward).

bf16 inputs on the "triton" backend run the passes in bf16 instead ("compose16"), as fla's two-pass composition
does: linear_attn's 16-bit kernels (tensor-core dots), K~ / V~ and their gradients rounded to bf16 between the
passes, decays and states in fp32. That is the default for hla2 and hla3 (and, through hilo_kernels.hla, their default
backend on CUDA for bf16 inputs). On the H200 (16K x 2, H = 16, D = 128, fwd+bwd) compose16 passes the bf16 check
of docs/kernels.md for all three ops (worst, with linear_attn's split scores: hla2 final state 3.9e-3, ahla o 4.3e-3
of its 5e-3 bound, hla3 o 4.3e-3) and takes hla2 4.1 ms against the fused kernels' 7.1, ahla 4.2 against 7.0 and
hla3 6.6-7.4 (fp32 passes: ahla's two took 200 ms). ahla keeps fp32 passes (and the fused kernels by default): at
T = 32,768 its compose16 output error is 5.4e-3 and 5.0e-3 of the bound with decays 0.999 and 0.99 (hla2 and hla3
there: 2.9-4.4e-3; benchmarks/hla_numerics.py). In float64 on CPU the rounding between passes alone moves the bf16
error ratio of o and every gradient from 1.65e-3 to 2.1-2.35e-3 at T = 4K and 16K.
"""

import torch

from hilo_kernels.linear_attn import linear_attn

from .state import STATE_TYPES, decay_powers, powered, split_normalized, with_ones


def _pass(q, k, v, g, power, state, output_final_state, cu_seqlens, backend, scale):
    # every pass is linear in q, so HLA's scale (on Q) is each pass's own: applied by linear_attn in fp32, no scaled
    # copy of q (under compose16 that copy would also round q * scale to bf16)
    return linear_attn(q, k, v, g=powered(g, power), scale=scale, initial_state=state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens, backend=backend)


# Input dtypes compose16 runs the passes in: bf16 only. fp16's range (65504) is too small for HLA's intermediates
# and outputs, which grow with t: with non-negative features and a weak decay, fp16 passes gave inf / NaN at T = 70.
COMPOSE16_DTYPES = (torch.bfloat16,)
# The ops compose16 applies to (see the module docstring: ahla's error at long T is too close to the bound).
COMPOSE16_OPS = ("hla2", "hla3")


def compose16(op: str, dtype: torch.dtype) -> bool:
    """Whether `op`'s composition runs its passes in `dtype`."""
    return dtype in COMPOSE16_DTYPES and op in COMPOSE16_OPS


def pass_dtype(op: str, dtype: torch.dtype, backend: str) -> torch.dtype:
    """The dtype the passes run in: the input's own under compose16 on "triton", else float32 (float64 for float64
    inputs)."""
    if backend == "triton" and compose16(op, dtype):
        return dtype
    return torch.promote_types(dtype, torch.float32)


def _one_op(op, backend, normalize, cu_seqlens, q, k, v) -> bool:
    """Whether a call takes hilo_kernels.hla.compose_op: hla2's or hla3's passes as one op on the "triton" backend,
    fixed-length, without normalize, where its fused gradient accumulation applies."""
    if not (backend == "triton" and not normalize and cu_seqlens is None):
        return False
    from .compose_op import applies

    return applies(op, q, k, v)


def hla_compose(op, q, k, v, g, decay, normalize, eps, scale, initial_state, output_final_state, cu_seqlens,
                backend):
    """op ("hla2", "ahla", "hla3") through linear_attn passes; returns (o [B, T, H, V] in q's dtype, op's
    state or None). backend is linear_attn's ("torch" or "triton")."""
    p_in, p_out = decay_powers(op, decay)
    dt = pass_dtype(op, q.dtype, backend)
    qs = q.to(dt)
    kk = k.to(dt)
    vv = with_ones(v.to(dt)) if normalize else v.to(dt)
    gg = None if g is None else g.to(torch.promote_types(dt, torch.float32))  # decays stay fp32 under compose16
    st = (None,) * len(STATE_TYPES[op]._fields) if initial_state is None else initial_state
    args = (output_final_state, cu_seqlens, backend, scale)
    if _one_op(op, backend, normalize, cu_seqlens, qs, kk, vv):
        from . import compose_op

        if op == "hla2":
            o, finals = compose_op.hla2_passes(qs, kk, vv, gg, st[0], st[1], scale, p_in, p_out, output_final_state)
        else:
            o, finals = compose_op.hla3_passes(qs, kk, vv, gg, *st, scale, output_final_state)
        return o.to(q.dtype), (STATE_TYPES[op](*finals) if output_final_state else None)
    if op == "hla2":
        kt, s = _pass(qs, kk, kk, gg, p_in, st[0], *args)
        o, f = _pass(qs, kt, vv, gg, p_out, st[1], *args)
        finals = (s, f)
    elif op == "ahla":
        vt, p = _pass(qs, kk, vv, gg, 1, st[0], *args)
        o, e = _pass(qs, kk, vt, gg, 1, st[1], *args)
        finals = (p, e)
    else:
        kt, s = _pass(qs, kk, kk, gg, 2, st[0], *args)
        vt, p = _pass(qs, kk, vv, gg, 1, st[1], *args)
        o, f = _pass(qs, kt, vt, gg, 1, st[2], *args)
        finals = (s, p, f)
    if normalize:  # the division in fp32 at least (compose16's passes return 16-bit o)
        o = split_normalized(o.to(torch.promote_types(o.dtype, torch.float32)), eps)
    return o.to(q.dtype), (STATE_TYPES[op](*finals) if output_final_state else None)
