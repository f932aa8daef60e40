"""One-token Gated DeltaNet update for decoding."""

import torch


def delta_rule_step(q, k, v, *, beta, g, state, scale=None):
    """One recurrent step on [B, H, *] tensors: q, k [B, H, K]; v [B, H, V]; beta [B, H]; g [B, H] or None;
    state [B, H, K, V] fp32. scale defaults to K ** -0.5.

    S' = exp(g) (I - beta k k^T) S + beta k v^T,  o = scale * q^T S'. Returns (o [B, H, V] in v's dtype,
    new state [B, H, K, V] fp32); the input state is not modified.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if state.shape != (*k.shape, v.shape[-1]):
        raise ValueError(f"delta_rule_step: expected state of shape {(*k.shape, v.shape[-1])} for k {tuple(k.shape)} "
                         f"and v {tuple(v.shape)}, got {tuple(state.shape)}")
    s = state.float()
    if g is not None:
        s = s * g.float().exp()[..., None, None]
    kf, vf, bf = k.float(), v.float(), beta.float()
    ks = torch.einsum("bhk,bhkv->bhv", kf, s)
    s = s + (bf[..., None, None] * kf[..., :, None]) * (vf - ks)[..., None, :]
    o = torch.einsum("bhk,bhkv->bhv", q.float() * scale, s)
    return o.to(v.dtype), s
