"""The definition (docs/kernels.md), token by token: the test oracle.

S_t = exp(g_t) S_{t-1} + k_t v_t^T,  o_t = scale * q_t^T S_t   (per head; S is K x V; S_0 = initial_state).
Computed in float32 (float64 when the inputs are float64); differentiable through autograd.
"""

import itertools

import torch


def linear_attn_naive(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens):
    """q, k [B, T, H, K], v [B, T, H, V], g [B, T, H] or None, initial_state [N, H, K, V] or None.
    Returns (o [B, T, H, V] in q's dtype, final_state [N, H, K, V] fp32 or None)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    dt = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf = (x.to(dt).reshape(b * t, h, x.shape[-1]) for x in (q, k, v))
    gf = None if g is None else g.to(dt).reshape(b * t, h)
    if cu_seqlens is None:
        bounds = [i * t for i in range(b + 1)]
    else:
        bounds = [int(x) for x in cu_seqlens.tolist()]
    outs, finals = [], []
    for n, (s, e) in enumerate(itertools.pairwise(bounds)):
        state = (torch.zeros(h, dk, dv, dtype=dt, device=q.device) if initial_state is None
                 else initial_state[n].to(dt))
        for i in range(s, e):
            if gf is not None:
                state = gf[i].exp()[:, None, None] * state
            state = state + kf[i][:, :, None] * vf[i][:, None, :]
            outs.append(scale * torch.einsum("hk,hkv->hv", qf[i], state))
        finals.append(state)
    o = torch.stack(outs, 0).reshape(b, t, h, dv).to(q.dtype) if outs else v.new_zeros(b, t, h, dv)
    final = torch.stack(finals, 0).to(torch.float32 if dt == torch.float32 else dt) if output_final_state else None
    return o, final
