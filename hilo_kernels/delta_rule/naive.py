"""The Gated DeltaNet recurrence (docs/kernels.md), token by token in fp32: the test oracle.

S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = scale * q_t^T S_t   (per head).
"""

import itertools

import torch


def delta_rule_naive(q, k, v, beta, g, scale, initial_state, output_final_state, bounds):
    """q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; g [B, T, H] or None; initial_state [N, H, K, V] or None.

    bounds: None (each batch row is one sequence) or the list of document boundaries (B == 1).
    Returns (o [B, T, H, V] in v's dtype, final_state [N, H, K, V] fp32 (float64 for float64
    inputs) or None). Differentiable by autograd
    (everything is computed out of place), so its gradients are the reference for the other backends.
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    segments = [(i, 0, t) for i in range(b)] if bounds is None else [
        (0, s, e) for s, e in itertools.pairwise(bounds)
    ]
    # fp32 accumulation (float64 inputs stay float64, so the oracle can run in double precision).
    acc = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf, bf = q.to(acc) * scale, k.to(acc), v.to(acc), beta.to(acc)
    gf = None if g is None else g.to(acc)
    outs, finals = [], []
    for n, (row, start, end) in enumerate(segments):
        if initial_state is not None:
            state = initial_state[n].to(acc)
        else:
            state = q.new_zeros(h, dk, dv, dtype=acc)
        seg_out = []
        for i in range(start, end):
            kt, vt, bt = kf[row, i], vf[row, i], bf[row, i]
            if gf is not None:
                state = state * gf[row, i].exp()[:, None, None]
            # (I - b k k^T) S = S - b k (k^T S): never form the K x K matrix.
            ks = torch.einsum("hk,hkv->hv", kt, state)
            state = state + bt[:, None, None] * kt[:, :, None] * (vt - ks)[:, None, :]
            seg_out.append(torch.einsum("hk,hkv->hv", qf[row, i], state))
        outs.append(torch.stack(seg_out, 0) if seg_out else vf.new_zeros(0, h, dv))
        finals.append(state)
    if bounds is None:
        o = torch.stack(outs, 0)
    else:
        o = torch.cat(outs, 0)[None]
    final = torch.stack(finals, 0) if output_final_state else None
    return o.to(v.dtype), final
