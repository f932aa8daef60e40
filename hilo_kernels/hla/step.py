"""One-token recurrent steps of the HLA family for decoding: the compositions of hilo_kernels.hla.compose, one token
at a time, each pass a hilo_kernels.linear_attn.linear_attn_step (scale 1, q multiplied by `scale` once).

    hla2:  k~, S' = step(q, k, k; p_in g, S)       o, F' = step(q, k~, v; p_out g, F)
    ahla:  v~, P' = step(q, k, v; g, P)            o, E' = step(q, k, v~; g, E)
    hla3:  k~, S' = step(q, k, k; 2g, S)           v~, P' = step(q, k, v; g, P)      o, F' = step(q, k~, v~; g, F)

The states are those of hilo_kernels.hla.state (per batch row instead of per document), so a prefill's final state
continues here, and stepping token by token equals the full forward.
"""

import torch

from hilo_kernels.linear_attn import linear_attn_step

from .state import STATE_TYPES, check_state, decay_powers, split_normalized, with_ones, zero_state


def hla_step(op, q, k, v, *, g=None, state=None, decay="d1", normalize=False, eps=1e-6, scale=1.0):
    """q, k [B, H, K], v [B, H, V], g [B, H] log decay or None, state op's state with N = B (None: zeros).

    Returns (o [B, H, V] in q's dtype, the new state, fp32 or float64 like the old one).
    """
    if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"{op}_step: expected q, k [B, H, K] and v [B, H, V], got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    p_in, p_out = decay_powers(op, decay)
    b, h, dk = q.shape
    dvs = v.shape[-1] + (1 if normalize else 0)
    if state is None:
        state = zero_state(op, b, h, dk, dvs, torch.promote_types(q.dtype, torch.float32), q.device)
    check_state(op, state, b, h, dk, dvs, q.device, normalize)
    dt = torch.promote_types(state[0].dtype, torch.float32)
    qs = q.to(dt) * scale
    kk = k.to(dt)
    vv = with_ones(v.to(dt)) if normalize else v.to(dt)
    gg = None if g is None else g.to(dt)

    def step(qx, kx, vx, power, s):
        return linear_attn_step(qx, kx, vx, g=None if gg is None else power * gg, state=s, scale=1.0)

    if op == "hla2":
        kt, s = step(qs, kk, kk, p_in, state.S)
        o, f = step(qs, kt, vv, p_out, state.F)
        new = (s, f)
    elif op == "ahla":
        vt, p = step(qs, kk, vv, 1, state.P)
        o, e = step(qs, kk, vt, 1, state.E)
        new = (p, e)
    else:
        kt, s = step(qs, kk, kk, 2, state.S)
        vt, p = step(qs, kk, vv, 1, state.P)
        o, f = step(qs, kt, vt, 1, state.F)
        new = (s, p, f)
    if normalize:
        o = split_normalized(o, eps)
    return o.to(q.dtype), STATE_TYPES[op](*new)


def hla2_step(q, k, v, *, g=None, state=None, decay="d1", normalize=False, eps=1e-6, scale=1.0):
    """One hla2 token: see hla_step; state HLA2State(S [B, H, K, K], F [B, H, K, V(+1)])."""
    return hla_step("hla2", q, k, v, g=g, state=state, decay=decay, normalize=normalize, eps=eps, scale=scale)


def ahla_step(q, k, v, *, g=None, state=None, decay="d1", normalize=False, eps=1e-6, scale=1.0):
    """One ahla token: see hla_step; state AHLAState(P [B, H, K, V(+1)], E [B, H, K, V(+1)])."""
    return hla_step("ahla", q, k, v, g=g, state=state, decay=decay, normalize=normalize, eps=eps, scale=scale)


def hla3_step(q, k, v, *, g=None, state=None, decay="d1", normalize=False, eps=1e-6, scale=1.0):
    """One hla3 token: see hla_step; state HLA3State(S [B, H, K, K], P, F [B, H, K, V(+1)])."""
    return hla_step("hla3", q, k, v, g=g, state=state, decay=decay, normalize=normalize, eps=eps, scale=scale)
