"""Chunked Gated DeltaNet in PyTorch: exact (up to fp32 rounding), differentiable by autograd, the CPU path.

Per chunk of C tokens, with gamma_t the inclusive cumsum of g inside the chunk, Gamma_ti = exp(gamma_t - gamma_i)
and S the state at the chunk start, the recurrence unrolls to S_t = e^{gamma_t} S + sum_{i<=t} Gamma_ti k_i u_i^T
with pseudo-values u_t = beta_t (v_t - e^{gamma_t} S^T k_t - sum_{i<t} Gamma_ti (k_t . k_i) u_i). In matrix form
(the WY/UT representation):

    A = strict_lower(diag(beta) (K K^T * Gamma)),   T = (I + A)^{-1}
    W = T diag(beta e^gamma) K,   U~ = T diag(beta) V,   U = U~ - W S
    O = scale * (diag(e^gamma) Q S + (Q K^T * Gamma * M) U)        (M: causal mask, diagonal included)
    S <- e^{gamma_C} S + (diag(e^{gamma_C - gamma}) K)^T U

Every exponent is a difference gamma_t - gamma_i with i <= t (or gamma itself), so it is <= 0 and never overflows.
"""

import itertools

import torch
import torch.nn.functional as F

CHUNK = 64


def _chunk_batch(q, k, v, beta, g, scale, state, chunk):
    """q, k [B, H, T, K]; v [B, H, T, V]; beta, g [B, H, T] (fp32); state [B, H, K, V] fp32.

    Returns (o [B, H, T, V] fp32, final state [B, H, K, V] fp32).
    """
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    nc = -(-t // chunk)
    pad = nc * chunk - t
    if pad:
        # Zero k, beta and g on padded tokens: they neither write nor decay the state.
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    q = q.reshape(b, h, nc, chunk, dk) * scale
    k = k.reshape(b, h, nc, chunk, dk)
    v = v.reshape(b, h, nc, chunk, dv)
    beta = beta.reshape(b, h, nc, chunk)
    gamma = g.reshape(b, h, nc, chunk).cumsum(-1)

    idx = torch.arange(chunk, device=q.device)
    incl = idx[:, None] >= idx[None, :]
    strict = idx[:, None] > idx[None, :]
    diff = gamma[..., :, None] - gamma[..., None, :]
    decay_incl = torch.exp(diff.masked_fill(~incl, float("-inf")))
    decay_strict = decay_incl * strict

    a = beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay_strict
    eye = torch.eye(chunk, device=q.device, dtype=q.dtype)
    lhs = eye + a
    w = torch.linalg.solve_triangular(lhs, (beta * gamma.exp())[..., None] * k, upper=False, unitriangular=True)
    u_tilde = torch.linalg.solve_triangular(lhs, beta[..., None] * v, upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay_incl
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * torch.exp(gamma[..., -1:] - gamma)[..., None]
    end_decay = gamma[..., -1].exp()

    outs = []
    # per-chunk views taken once by unbind (indexing inside the loop would add a full-size zero gradient per chunk)
    per_chunk = zip(*(x.unbind(2) for x in (u_tilde, w, q_decayed, qk, end_decay, k_to_end)), strict=True)
    for u_c, w_c, qd_c, qk_c, end_c, kend_c in per_chunk:
        u = u_c - w_c @ state
        outs.append(qd_c @ state + qk_c @ u)
        state = end_c[:, :, None, None] * state + kend_c.transpose(-1, -2) @ u
    o = torch.stack(outs, 2).reshape(b, h, nc * chunk, dv)[:, :, :t]
    return o, state


def delta_rule_chunk(q, k, v, beta, g, scale, initial_state, output_final_state, bounds, chunk=CHUNK):
    """Same contract as hilo_kernels.delta_rule.naive.delta_rule_naive, computed chunk by chunk (chunk tokens each)."""
    b, _, h, dk = q.shape
    dv = v.shape[-1]
    out_dtype = v.dtype
    acc = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf = (x.to(acc).transpose(1, 2) for x in (q, k, v))
    bf = beta.to(acc).transpose(1, 2)
    gf = torch.zeros_like(bf) if g is None else g.to(acc).transpose(1, 2)
    if bounds is None:
        if initial_state is None:
            state = qf.new_zeros(b, h, dk, dv)
        else:
            state = initial_state.to(acc)
        o, final = _chunk_batch(qf, kf, vf, bf, gf, scale, state, chunk)
        o = o.transpose(1, 2)
        return o.to(out_dtype), (final if output_final_state else None)
    outs, finals = [], []
    for n, (s, e) in enumerate(itertools.pairwise(bounds)):
        if initial_state is None:
            state = qf.new_zeros(1, h, dk, dv)
        else:
            state = initial_state[n : n + 1].to(acc)
        if e == s:
            finals.append(state[0])
            continue
        o, final = _chunk_batch(qf[:, :, s:e], kf[:, :, s:e], vf[:, :, s:e], bf[:, :, s:e], gf[:, :, s:e], scale,
                                state, chunk)
        outs.append(o)
        finals.append(final[0])
    o = torch.cat(outs, 2).transpose(1, 2) if outs else vf.new_zeros(1, 0, h, dv)
    return o.to(out_dtype), (torch.stack(finals, 0) if output_final_state else None)
