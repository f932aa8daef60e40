"""One-token log-linear Gated DeltaNet step for decoding (the recurrent form of docs/kernels.md), O(log T) per token.

With t = state.tokens: binary carry (levels 0..m into m + 1, m the trailing zero bits of t >= 1), then every level
goes through exp(g)(I - beta k k^T), beta k v^T is written to level 0 and o = scale * sum_l lambda[l] q^T S^(l).
Vectorised over levels and rows (each row at its own position); no host synchronisation.
"""

import torch

from hilo_kernels.loglinear_attn.state import LogLinearState, binary_carry, check_step_state


def loglinear_delta_rule_step(q, k, v, *, beta, g, level_scales, state, scale=None):
    """q, k [B, H, K], v [B, H, V], beta [B, H], g [B, H] or None, level_scales [B, H, L], state LogLinearState
    (levels [B, H, Ls, K, V] fp32 with Ls <= L and Ls >= bit_length(position) + 1; tokens [B]).

    Returns (o [B, H, V] in v's dtype, the new LogLinearState: same number of levels, tokens + 1).
    """
    if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"loglinear_delta_rule_step: expected q, k [B, H, K] and v [B, H, V], got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if tuple(beta.shape) != tuple(q.shape[:2]) or (g is not None and tuple(g.shape) != tuple(q.shape[:2])):
        raise ValueError(f"loglinear_delta_rule_step: beta and g must be [B, H] = {tuple(q.shape[:2])}")
    nl = check_step_state("loglinear_delta_rule_step", q, v, level_scales, state)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    dt = torch.promote_types(state.levels.dtype, torch.float32)
    s = binary_carry(state.levels.to(dt), state.tokens)
    kf, bf = k.to(dt), beta.to(dt)
    ks = kf[:, :, None, None, :] @ s  # [B, H, L, 1, V]
    s = s - bf[:, :, None, None, None] * kf[:, :, None, :, None] * ks
    if g is not None:
        s = s * g.to(dt).exp()[:, :, None, None, None]
    write = bf[:, :, None, None] * kf[:, :, :, None] * v.to(dt)[:, :, None, :]
    s = torch.cat([s[:, :, :1] + write[:, :, None], s[:, :, 1:]], 2)
    b, h, _, dk, dv = s.shape
    lq = level_scales[..., :nl].to(dt)[..., None] * q.to(dt)[:, :, None, :]  # [B, H, L, K]
    o = scale * (lq.reshape(b, h, 1, nl * dk) @ s.reshape(b, h, nl * dk, dv))[:, :, 0]
    return o.to(v.dtype), LogLinearState(s, state.tokens + 1)
