"""The two reference forms of log-linear attention (docs/kernels.md), in fp32 (float64 for float64 inputs), differentiable.

Definition (per head; t, s positions in the document; G_t = sum_{r <= t} g_r):
    o_t = scale * sum_{s <= t} lambda_t[l(t, s)] exp(G_t - G_s) (q_t . k_s) v_s,   l(t, s) = bit_length(t XOR s)

`loglinear_attn_quadratic` evaluates it as a masked T x T matrix (O(T^2)); `loglinear_attn_naive` runs the
binary-carry recurrence token by token (O(T log T)): one K x V state per level; at position t >= 1 with m trailing
zero bits, levels 0..m are added into level m + 1 and cleared, then every level decays by exp(g_t), k_t v_t^T is
written to level 0 and o_t = scale * sum_l lambda_t[l] q_t^T S^(l).

A prior state (see hilo_kernels.loglinear_attn.state) shifts positions to start at `tokens`; the quadratic form adds
its levels through level max(l, bit_length(t XOR (tokens - 1))).
"""

import torch

from .state import level_of, prior_level, segments


def _read(lam, q, state):
    """sum_l lam[l] q^T S^(l) for one token: lam [H, L], q [H, K], state [H, L, K, V] -> [H, V]."""
    h, nl, dk, dv = state.shape
    lq = (lam[:, :, None] * q[:, None, :]).reshape(h, 1, nl * dk)
    return torch.bmm(lq, state.reshape(h, nl * dk, dv))[:, 0]


def carry(state: torch.Tensor, pos: int) -> torch.Tensor:
    """The binary carry (docs/kernels.md) before the token at position pos of one sequence (none at 0): with m = the number of
    trailing zero bits of pos, levels 0..m are added into level m + 1 and cleared. state is [H, L, K, V]."""
    if pos == 0:
        return state
    m = ((pos & -pos).bit_length()) - 1
    merged = state[:, : m + 1].sum(1, keepdim=True)
    return torch.cat([torch.zeros_like(state[:, : m + 1]), state[:, m + 1: m + 2] + merged, state[:, m + 2:]], 1)


def _acc(x):
    return torch.promote_types(x.dtype, torch.float32)


def _pack(o_parts, finals, b, t, h, dv, cu_seqlens, dtype, acc, output_final_state):
    if cu_seqlens is None:
        o = torch.stack(o_parts, 0)
    else:
        o = torch.cat(o_parts, 0)[None]
    o = o.reshape(b, t, h, dv).to(dtype)
    if not output_final_state:
        return o, None
    return o, torch.stack(finals, 0)


def loglinear_attn_naive(q, k, v, g, level_scales, scale, initial_state, output_final_state, cu_seqlens, starts):
    """The binary-carry recurrence. q, k [B, T, H, K], v [B, T, H, V], g [B, T, H] or None, level_scales
    [B, T, H, L]; initial_state LogLinearState or None; starts: each sequence's first position.
    Returns (o [B, T, H, V] in q's dtype, final levels [N, H, L, K, V] or None)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    nl = level_scales.shape[-1]
    acc = _acc(q)
    qf, kf, vf, lf = (x.to(acc) for x in (q, k, v, level_scales))
    gf = None if g is None else g.to(acc)
    o_parts, finals = [], []
    for n, (row, s, e) in enumerate(segments(b, t, cu_seqlens)):
        state = (q.new_zeros(h, nl, dk, dv, dtype=acc) if initial_state is None or starts[n] == 0
                 else initial_state.levels[n].to(acc))
        outs = []
        for i in range(s, e):
            pos = starts[n] + i - s
            state = carry(state, pos)
            if gf is not None:
                state = state * gf[row, i].exp()[:, None, None, None]
            write = kf[row, i][:, :, None] * vf[row, i][:, None, :]
            state = torch.cat([state[:, :1] + write[:, None], state[:, 1:]], 1)
            outs.append(scale * _read(lf[row, i], qf[row, i], state))
        o_parts.append(torch.stack(outs, 0) if outs else vf.new_zeros(0, h, dv))
        finals.append(state)
    return _pack(o_parts, finals, b, t, h, dv, cu_seqlens, q.dtype, acc, output_final_state)


def loglinear_attn_quadratic(q, k, v, g, level_scales, scale, initial_state, output_final_state, cu_seqlens,
                             starts):
    """The definition as a masked matrix per sequence (O(T^2)); same contract as loglinear_attn_naive."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    nl = level_scales.shape[-1]
    acc = _acc(q)
    dev = q.device
    o_parts, finals = [], []
    for n, (row, s, e) in enumerate(segments(b, t, cu_seqlens)):
        p0 = starts[n]
        prior = None if initial_state is None or p0 == 0 else initial_state.levels[n].to(acc)
        ln = e - s
        qf, kf, vf, lf = (x[row, s:e].to(acc) for x in (q, k, v, level_scales))
        big_g = torch.zeros(ln, h, dtype=acc, device=dev) if g is None else g[row, s:e].to(acc).cumsum(0)
        pos = p0 + torch.arange(ln, device=dev, dtype=torch.int64)
        lev = level_of(pos[:, None], pos[None, :])  # [t, s]
        causal = pos[:, None] >= pos[None, :]
        diff = big_g[:, None, :] - big_g[None, :, :]  # [t, s, h]
        decay = torch.where(causal[..., None], diff, torch.full_like(diff, float("-inf"))).exp()
        lam = torch.gather(lf, 2, lev.clamp(max=nl - 1)[:, :, None].expand(ln, ln, h).permute(0, 2, 1))
        weight = decay * lam.permute(0, 2, 1)  # [t, s, h]
        o = scale * torch.einsum("tsh,thk,shk,shv->thv", weight, qf, kf, vf)
        if ln:
            end = p0 + ln - 1
            lev_end = level_of(torch.tensor(end, device=dev), pos)
            onehot = (lev_end[:, None] == torch.arange(nl, device=dev)).to(acc)  # [s, L]
            to_end = (big_g[-1][None] - big_g).exp()  # [s, h]
            final = torch.einsum("sl,sh,shk,shv->hlkv", onehot, to_end, kf, vf)
        else:
            final = q.new_zeros(h, nl, dk, dv, dtype=acc)
        if prior is not None:
            idx = prior_level(pos, p0, nl)  # [t, L]
            lam_p = torch.gather(lf, 2, idx[:, None, :].expand(ln, h, nl))  # [t, h, L]
            o = o + scale * torch.einsum("thl,th,thk,hlkv->thv", lam_p, big_g.exp(), qf, prior)
            if ln:
                idx_end = prior_level(torch.tensor([end], device=dev), p0, nl)[0]
                move = (idx_end[:, None] == torch.arange(nl, device=dev)[None]).to(acc)  # [from, to]
                final = final + torch.einsum("lm,h,hlkv->hmkv", move, big_g[-1].exp(), prior)
            else:
                final = final + prior
        o_parts.append(o)
        finals.append(final)
    return _pack(o_parts, finals, b, t, h, dv, cu_seqlens, q.dtype, acc, output_final_state)
