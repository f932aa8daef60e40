"""References for the HLA family (docs/kernels.md): the masked matrices, the token recurrences, the chunked algorithm.

Per head, q already multiplied by `scale`, b_t = prod_{r <= t} exp(g_r), D_ts = b_t / b_s [s <= t],
L the causal mask (s <= t) and W = D * (q k^T) (W = L * (q k^T) without decay):

    hla2 "d1"  o = ((W W^T) * L) v               o_t = sum_{i <= j <= t} (b_t/b_i)(b_j/b_i) (q_t.k_i)(k_i.q_j) v_j
    hla2 "d2"  o = ((W (L * q k^T)^T) * D) v     o_t = sum_{i <= j <= t} (b_t/b_i)(b_t/b_j) (q_t.k_i)(k_i.q_j) v_j
    ahla       o = W (W v)                       o_t = sum_{j <= i <= t} (b_t/b_j) (q_t.k_i)(q_i.k_j) v_j
    hla3       o = ((((W W^T) * L) W) * L) v     o_t = sum_{i, l <= j <= t} (b_t/b_i)(b_j/b_i)(b_j/b_l)
                                                               (q_t.k_i)(k_i.q_j)(q_j.k_l) v_l

`hla_masked` builds these T x T matrices (small T only; the definition). The token recurrences (the "naive"
backend: the oracle with state, varlen and normalization) are, with a = exp(g_t) and (p_in, p_out) from
hilo_kernels.hla.state.decay_powers:

    hla2:  S_t = a^p_in S_{t-1} + k_t k_t^T,   F_t = a^p_out F_{t-1} + (S_t^T q_t) v_t^T,  o_t = q_t^T F_t
    ahla:  P_t = a P_{t-1} + k_t v_t^T,        E_t = a E_{t-1} + k_t (P_t^T q_t)^T,        o_t = q_t^T E_t
    hla3:  S_t = a^2 S_{t-1} + k_t k_t^T,      P_t = a P_{t-1} + k_t v_t^T,
           F_t = a F_{t-1} + (S_t^T q_t)(P_t^T q_t)^T,                                     o_t = q_t^T F_t

(unrolling each gives the sums above; S^T q, as linear_attn reads its state, equals S q for states built from
tokens, which are symmetric). `hla2_chunked` is the one-pass chunked second-order algorithm (the
fused kernel's algorithm) in PyTorch.
"""

import itertools

import torch

from .state import STATE_TYPES, decay_powers, split_normalized, with_ones, zero_state


def _decay_mask(g: torch.Tensor | None, t: int, dtype, device) -> torch.Tensor:
    """D [B, H, T, T] (or [T, T] without g): exp(G_t - G_s) for s <= t, else 0."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    if g is None:
        return causal.to(dtype)
    cum = torch.cumsum(g.to(dtype), dim=1).transpose(1, 2)  # [B, H, T]
    diff = cum[..., :, None] - cum[..., None, :]
    return torch.where(causal, diff, torch.full_like(diff, float("-inf"))).exp()


def hla_masked(op: str, q, k, v, g=None, *, decay: str = "d1", scale: float = 1.0) -> torch.Tensor:
    """The masked matrix definition of `op` ("hla2", "ahla", "hla3") for one batch of sequences.

    q, k [B, T, H, K], v [B, T, H, V], g [B, T, H] log decays or None. Computes in float64 for float64 inputs
    (float32 otherwise) and returns o [B, T, H, V] in that dtype. O(T^2) memory, O(T^3) work: tests only.
    """
    decay_powers(op, decay)
    dt = torch.promote_types(q.dtype, torch.float32)
    t = q.shape[1]
    qh, kh, vh = (x.to(dt).transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
    qh = qh * scale
    causal = torch.ones(t, t, dtype=dt, device=q.device).tril()
    dmask = _decay_mask(g, t, dt, q.device)
    a = qh @ kh.transpose(-1, -2)
    w = dmask * a
    if op == "hla2" and decay == "d1":
        o = ((w @ w.transpose(-1, -2)) * causal) @ vh
    elif op == "hla2":
        o = ((w @ (causal * a).transpose(-1, -2)) * dmask) @ vh
    elif op == "ahla":
        o = w @ (w @ vh)
    else:
        o = ((((w @ w.transpose(-1, -2)) * causal) @ w) * causal) @ vh
    return o.transpose(1, 2)


def _token_update(op: str, state, q, k, v, a, p_in, p_out):
    """One token of op's recurrence for all heads: q, k [H, K], v [H, Vs], a [H] decay factor (or None)."""
    def dec(x, p):
        return x if a is None else (a ** p)[:, None, None] * x

    outer = torch.einsum
    if op == "hla2":
        s = dec(state.S, p_in) + outer("hk,hl->hkl", k, k)
        f = dec(state.F, p_out) + outer("hk,hv->hkv", outer("hk,hkl->hl", q, s), v)
        return STATE_TYPES[op](s, f), outer("hk,hkv->hv", q, f)
    if op == "ahla":
        p = dec(state.P, 1) + outer("hk,hv->hkv", k, v)
        e = dec(state.E, 1) + outer("hk,hv->hkv", k, outer("hk,hkv->hv", q, p))
        return STATE_TYPES[op](p, e), outer("hk,hkv->hv", q, e)
    s = dec(state.S, 2) + outer("hk,hl->hkl", k, k)
    p = dec(state.P, 1) + outer("hk,hv->hkv", k, v)
    f = dec(state.F, 1) + outer("hk,hv->hkv", outer("hk,hkl->hl", q, s), outer("hk,hkv->hv", q, p))
    return STATE_TYPES[op](s, p, f), outer("hk,hkv->hv", q, f)


def hla_recurrent(op, q, k, v, g, decay, normalize, eps, scale, initial_state, output_final_state, cu_seqlens):
    """op's token recurrence (the "naive" backend). Same contract as hilo_kernels.hla2/ahla/hla3: returns
    (o [B, T, H, V] in q's dtype, op's state [N, ...] or None). Differentiable through autograd."""
    p_in, p_out = decay_powers(op, decay)
    b, t, h, dk = q.shape
    dt = torch.promote_types(q.dtype, torch.float32)
    vv = with_ones(v.to(dt)) if normalize else v.to(dt)
    dvs = vv.shape[-1]
    qf = (q.to(dt) * scale).reshape(b * t, h, dk)
    kf = k.to(dt).reshape(b * t, h, dk)
    vf = vv.reshape(b * t, h, dvs)
    af = None if g is None else g.to(dt).reshape(b * t, h).exp()
    bounds = [i * t for i in range(b + 1)] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    outs, finals = [], []
    for n, (s, e) in enumerate(itertools.pairwise(bounds)):
        if initial_state is None:
            state = zero_state(op, 1, h, dk, dvs, dt, q.device)
            state = STATE_TYPES[op](*(x[0] for x in state))
        else:
            state = STATE_TYPES[op](*(x[n].to(dt) for x in initial_state))
        for i in range(s, e):
            state, o = _token_update(op, state, qf[i], kf[i], vf[i], None if af is None else af[i], p_in, p_out)
            outs.append(o)
        finals.append(state)
    o = torch.stack(outs, 0).reshape(b, t, h, dvs) if outs else vv.new_zeros(b, t, h, dvs)
    if normalize:
        o = split_normalized(o, eps)
    final = None
    if output_final_state:
        final = STATE_TYPES[op](*(torch.stack(list(fields), 0) for fields in zip(*finals, strict=True)))
    return o.to(q.dtype), final


def hla2_chunked(q, k, v, g=None, *, decay: str = "d1", scale: float = 1.0, chunk: int = 16,
                 initial_state=None, output_final_state: bool = False):
    """The one-pass chunked second-order algorithm (the fused kernel's), for B sequences without cu_seqlens.

    Per chunk of C tokens, with l the in-chunk inclusive cumsum of g, Gamma^(p)_tj = exp(p (l_t - l_j)) [j <= t]
    and (p_in, p_out) = (2, 1) for "d1", (1, 2) for "d2", from the carried S (K x K) and F (K x V):
        Kt = diag(e^{p_in l}) Q S + (Gamma^(p_in) * Q K^T) K          (row t: k~_t = S_t^T q_t)
        O  = diag(e^{p_out l}) Q F + (Gamma^(p_out) * Q Kt^T) V
        F <- e^{p_out l_C} F + Kt^T diag(e^{p_out (l_C - l)}) V
        S <- e^{p_in l_C} S + K^T diag(e^{p_in (l_C - l)}) K
    Never forms W W^T. q, k [B, T, H, K], v [B, T, H, V], g [B, T, H] or None; initial_state HLA2State or None.
    Returns (o [B, T, H, V], HLA2State or None), computed in float32 (float64 for float64 inputs).
    """
    p_in, p_out = decay_powers("hla2", decay)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    dt = torch.promote_types(q.dtype, torch.float32)
    nc = -(-t // chunk)
    pad = nc * chunk - t

    def blocks(x):
        x = torch.nn.functional.pad(x.to(dt), (0, 0) * (x.ndim - 3) + (0, 0, 0, pad))
        return x.reshape(b, nc, chunk, *x.shape[2:]).transpose(2, 3)  # [B, NC, H, C, ...]

    qc, kc, vc = blocks(q * scale), blocks(k), blocks(v)
    gc = blocks(torch.zeros(b, t, h, dtype=dt, device=q.device) if g is None else g)
    ell = torch.cumsum(gc, dim=-1)
    last = ell[..., -1:]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()

    def gamma(p):
        diff = p * (ell[..., :, None] - ell[..., None, :])
        return torch.where(causal, diff, torch.full_like(diff, float("-inf"))).exp()

    gam_in, gam_out = gamma(p_in), gamma(p_out)
    qk = qc @ kc.transpose(-1, -2)
    s = torch.zeros(b, h, dk, dk, dtype=dt, device=q.device) if initial_state is None else initial_state.S.to(dt)
    f = torch.zeros(b, h, dk, dv, dtype=dt, device=q.device) if initial_state is None else initial_state.F.to(dt)
    outs = []
    for c in range(nc):
        qb, kb, vb, lb, lc = qc[:, c], kc[:, c], vc[:, c], ell[:, c, :, :, None], last[:, c, :, :, None]
        kt = (p_in * lb).exp() * (qb @ s) + (gam_in[:, c] * qk[:, c]) @ kb
        outs.append((p_out * lb).exp() * (qb @ f) + (gam_out[:, c] * (qb @ kt.transpose(-1, -2))) @ vb)
        f = (p_out * lc).exp() * f + kt.transpose(-1, -2) @ ((p_out * (lc - lb)).exp() * vb)
        s = (p_in * lc).exp() * s + kb.transpose(-1, -2) @ ((p_in * (lc - lb)).exp() * kb)
    o = torch.stack(outs, 1).transpose(2, 3).reshape(b, nc * chunk, h, dv)[:, :t]
    return o, (STATE_TYPES["hla2"](s, f) if output_final_state else None)
