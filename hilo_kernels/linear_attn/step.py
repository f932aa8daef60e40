"""One-token recurrent update for decoding (docs/kernels.md): S' = exp(g) S + k v^T, o = scale * q^T S'."""

import torch


def linear_attn_step(q, k, v, *, g, state, scale=None):
    """q, k [B, H, K], v [B, H, V], g [B, H] log decay or None, state [B, H, K, V] fp32.

    Returns (o [B, H, V] in q's dtype, new_state [B, H, K, V] fp32). scale defaults to K ** -0.5.
    """
    if q.ndim != 3 or k.shape != q.shape or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"linear_attn_step: expected q, k [B, H, K] and v [B, H, V], got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, h, dk = q.shape
    dv = v.shape[-1]
    if tuple(state.shape) != (b, h, dk, dv):
        raise ValueError(f"linear_attn_step: state must be [B={b}, H={h}, K={dk}, V={dv}], got "
                         f"{tuple(state.shape)}")
    if g is not None and tuple(g.shape) != (b, h):
        raise ValueError(f"linear_attn_step: g must be [B={b}, H={h}], got {tuple(g.shape)}")
    if scale is None:
        scale = dk ** -0.5
    dt = torch.promote_types(state.dtype, torch.float32)
    s = state.to(dt)
    if g is not None:
        s = g.to(dt).exp()[:, :, None, None] * s
    s = s + k.to(dt)[:, :, :, None] * v.to(dt)[:, :, None, :]
    o = scale * torch.einsum("bhk,bhkv->bhv", q.to(dt), s)
    return o.to(q.dtype), s
