"""One-token log-linear attention step for decoding (the recurrent form of docs/kernels.md), O(log T) per token.

With t = state.tokens (this token's position): binary carry (t >= 1, m trailing zero bits of t: levels 0..m are
added into level m + 1 and cleared), then every level decays by exp(g), k v^T is written to level 0 and
o = scale * sum_l lambda[l] q^T S^(l). All levels are updated by tensor ops (no host synchronisation, no Python loop
over levels), each row at its own position.
"""

import torch

from .state import LogLinearState, binary_carry, check_step_state


def loglinear_attn_step(q, k, v, *, g, level_scales, state, scale=None):
    """q, k [B, H, K], v [B, H, V], g [B, H] log decay or None, level_scales [B, H, L], state LogLinearState with
    levels [B, H, Ls, K, V] fp32 (Ls <= L; Ls >= bit_length(position) + 1, grow it with state.grow) and tokens [B].

    Returns (o [B, H, V] in q's dtype, the new LogLinearState: same number of levels, tokens + 1).
    """
    if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"loglinear_attn_step: expected q, k [B, H, K] and v [B, H, V], got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    nl = check_step_state("loglinear_attn_step", q, v, level_scales, state)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    dt = torch.promote_types(state.levels.dtype, torch.float32)
    s = binary_carry(state.levels.to(dt), state.tokens)
    if g is not None:
        s = s * g.to(dt).exp()[:, :, None, None, None]
    write = k.to(dt)[:, :, :, None] * v.to(dt)[:, :, None, :]
    s = torch.cat([s[:, :, :1] + write[:, :, None], s[:, :, 1:]], 2)
    b, h, _, dk, dv = s.shape
    lq = level_scales[..., :nl].to(dt)[..., None] * q.to(dt)[:, :, None, :]  # [B, H, L, K]
    o = scale * (lq.reshape(b, h, 1, nl * dk) @ s.reshape(b, h, nl * dk, dv))[:, :, 0]
    return o.to(q.dtype), LogLinearState(s, state.tokens + 1)
