"""The two reference forms of log-linear Gated DeltaNet (docs/kernels.md), in fp32 (float64 for float64 inputs),
differentiable by autograd.

Definition (per head; t, s positions in the document):
    o_t = scale * sum_{s <= t} lambda_t[l(t, s)] q_t^T P_{t<-s} beta_s k_s v_s^T,
    P_{t<-s} = prod_{r = s+1..t} exp(g_r) (I - beta_r k_r k_r^T),      l(t, s) = bit_length(t XOR s)

`loglinear_delta_rule_quadratic` evaluates every q_t^T P_{t<-s} k_s by a backward sweep over s that carries all rows
q_t^T P_{t<-s} at once (O(T^2 K)); `loglinear_delta_rule_naive` runs the binary-carry recurrence token by token:
carry as in loglinear_attn, then every level goes through exp(g_t)(I - beta_t k_t k_t^T), beta_t k_t v_t^T is
written to level 0 and o_t = scale * sum_l lambda_t[l] q_t^T S^(l).
"""

import torch

from hilo_kernels.loglinear_attn.naive import _pack, _read, carry
from hilo_kernels.loglinear_attn.state import level_of, prior_level, segments


def loglinear_delta_rule_naive(q, k, v, beta, g, level_scales, scale, initial_state, output_final_state,
                               cu_seqlens, starts):
    """The binary-carry recurrence. q, k [B, T, H, K], v [B, T, H, V], beta [B, T, H], g [B, T, H] or None,
    level_scales [B, T, H, L]; initial_state LogLinearState or None; starts: each sequence's first position.
    Returns (o [B, T, H, V] in v's dtype, final levels [N, H, L, K, V] or None)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    nl = level_scales.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf, bf, lf = (x.to(acc) for x in (q, k, v, beta, level_scales))
    gf = None if g is None else g.to(acc)
    o_parts, finals = [], []
    for n, (row, s, e) in enumerate(segments(b, t, cu_seqlens)):
        state = (q.new_zeros(h, nl, dk, dv, dtype=acc) if initial_state is None or starts[n] == 0
                 else initial_state.levels[n].to(acc))
        outs = []
        for i in range(s, e):
            pos = starts[n] + i - s
            state = carry(state, pos)
            kt, bt = kf[row, i], bf[row, i]
            ks = kt[:, None, None, :] @ state  # [H, L, 1, V]
            state = state - bt[:, None, None, None] * kt[:, None, :, None] * ks
            if gf is not None:
                state = state * gf[row, i].exp()[:, None, None, None]
            write = bt[:, None, None] * kt[:, :, None] * vf[row, i][:, None, :]
            state = torch.cat([state[:, :1] + write[:, None], state[:, 1:]], 1)
            outs.append(scale * _read(lf[row, i], qf[row, i], state))
        o_parts.append(torch.stack(outs, 0) if outs else vf.new_zeros(0, h, dv))
        finals.append(state)
    return _pack(o_parts, finals, b, t, h, dv, cu_seqlens, v.dtype, acc, output_final_state)


def loglinear_delta_rule_quadratic(q, k, v, beta, g, level_scales, scale, initial_state, output_final_state,
                                   cu_seqlens, starts):
    """The definition as a T x T matrix per sequence; same contract as loglinear_delta_rule_naive.

    Rows r_t = q_t^T P_{t<-s} for every query t (and K identity rows at the last position, for the final levels)
    are swept from s = last down to the first position: E[t, s] = beta_s r_t . k_s, then r_t <- r_t P_s for the
    rows with t >= s. After the sweep r_t = q_t^T P_{t<-p0-1}, which reads the prior levels."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    nl = level_scales.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    dev = q.device
    o_parts, finals = [], []
    for n, (row, s, e) in enumerate(segments(b, t, cu_seqlens)):
        p0 = starts[n]
        prior = None if initial_state is None or p0 == 0 else initial_state.levels[n].to(acc)
        ln = e - s
        if ln == 0:
            o_parts.append(q.new_zeros(0, h, dv, dtype=acc))
            finals.append(prior if prior is not None else q.new_zeros(h, nl, dk, dv, dtype=acc))
            continue
        qf, kf, vf, bf, lf = (x[row, s:e].to(acc) for x in (q, k, v, beta, level_scales))
        gf = torch.zeros(ln, h, dtype=acc, device=dev) if g is None else g[row, s:e].to(acc)
        pos = p0 + torch.arange(ln, device=dev, dtype=torch.int64)
        end = p0 + ln - 1
        rows_pos = torch.cat([pos, torch.full((dk,), end, device=dev, dtype=torch.int64)])
        eye = torch.eye(dk, dtype=acc, device=dev)[:, None, :].expand(dk, h, dk)
        r = torch.cat([qf, eye], 0)  # [t + K, h, K]
        cols = []
        for i in range(ln - 1, -1, -1):
            active = (rows_pos >= pos[i])[:, None]
            rk = (r * kf[i][None]).sum(-1)  # [t + K, h]
            cols.append(bf[i][None] * rk * active)
            stepped = gf[i].exp()[None, :, None] * (r - bf[i][None, :, None] * rk[..., None] * kf[i][None])
            r = torch.where(active[..., None], stepped, r)
        e_mat = torch.stack(cols[::-1], 2)  # [t + K, h, s]
        lev = level_of(pos[:, None], pos[None, :]).clamp(max=nl - 1)  # [t, s]
        lam = torch.gather(lf, 2, lev[:, None, :].expand(ln, h, ln))  # [t, h, s]
        o = scale * torch.einsum("ths,ths,shv->thv", lam, e_mat[:ln], vf)
        lev_end = level_of(torch.tensor(end, device=dev), pos)
        onehot = (lev_end[:, None] == torch.arange(nl, device=dev)).to(acc)  # [s, L]
        final = torch.einsum("khs,sl,shv->hlkv", e_mat[ln:], onehot, vf)
        if prior is not None:
            idx = prior_level(pos, p0, nl)
            lam_p = torch.gather(lf, 2, idx[:, None, :].expand(ln, h, nl))  # [t, h, L]
            o = o + scale * torch.einsum("thl,thk,hlkv->thv", lam_p, r[:ln], prior)
            idx_end = prior_level(torch.tensor([end], device=dev), p0, nl)[0]
            move = (idx_end[:, None] == torch.arange(nl, device=dev)[None]).to(acc)  # [from, to]
            final = final + torch.einsum("lm,khj,hljv->hmkv", move, r[ln:], prior)
        o_parts.append(o)
        finals.append(final)
    return _pack(o_parts, finals, b, t, h, dv, cu_seqlens, v.dtype, acc, output_final_state)
