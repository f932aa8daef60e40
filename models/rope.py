"""Rotary position embedding (rotate-half layout) driven by explicit position_ids."""

import torch

# The last rope_tables result with its key (position_ids, its _version, head_dim, theta): every RoPE layer of a
# forward passes the same position_ids, so the tables are computed once per forward, not once per layer.
_last_tables: tuple = ()


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of angle[b, t, i] = position_ids[b, t] * theta ** (-2i / head_dim), i < head_dim / 2; fp32 [B, T, D/2].

    Positions come from the caller, so packed documents restart at 0 and cached decoding continues the count.
    """
    if head_dim % 2 != 0:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    inv_freq = theta ** (
        -torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
    )
    angles = position_ids.to(torch.float32)[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., i], x[..., i + D/2]) of x [B, T, H, D] by the angles of cos/sin [B, T, D/2]."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def rope_tables(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cat(cos, cos), cat(-sin, sin)) [B, T, 1, D] fp32 from rope_cos_sin, for rotate(x, tables).

    Returns the previous call's tables when position_ids is the same, unmodified tensor with the same head_dim and
    theta (the layers of one forward), so an eager decoding step computes them once rather than in every layer.
    Never reused under torch.compile (the graph computes them; a guard on the cached tensor would recompile every
    step) nor for inference tensors (torch.inference_mode: no version counter to tell an in-place change).
    """
    global _last_tables
    if torch.compiler.is_compiling() or position_ids.is_inference():
        return _tables(position_ids, head_dim, theta)
    key = (position_ids._version, head_dim, theta)
    if _last_tables and _last_tables[0] is position_ids and _last_tables[1] == key:
        return _last_tables[2]
    tables = _tables(position_ids, head_dim, theta)
    _last_tables = (position_ids, key, tables)
    return tables


def _tables(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rope_cos_sin(position_ids, head_dim, theta)
    return torch.cat((cos, cos), -1)[:, :, None], torch.cat((-sin, sin), -1)[:, :, None]


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """apply_rope(x, cos, sin) with the tables of rope_tables, bit for bit: x cos + (x2, x1) (-sin, sin) gives
    x1 c - x2 s and x2 c + x1 s exactly, in half of apply_rope's operations (the tables are shared by q and k)."""
    cos, sin = tables
    half = x.shape[-1] // 2
    xf = x.float()
    return (xf * cos + torch.cat((xf[..., half:], xf[..., :half]), -1) * sin).to(x.dtype)
