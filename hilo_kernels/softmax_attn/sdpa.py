"""Softmax attention through torch.nn.functional.scaled_dot_product_attention.

SDPA picks the fastest kernel it can (cuDNN, flash, memory-efficient, math). Packed documents run one SDPA
call per document: a block-diagonal mask would force the O(T^2)-memory math kernel and lose the fused ones.
"""

import itertools

import torch
import torch.nn.functional as F


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
          key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """One dense call on [B, T, H, D] tensors with bottom-right causal alignment (and key_mask [Tk] or [B, Tk], if
    any)."""
    tq, tk = q.shape[1], k.shape[1]
    mask = None
    is_causal = False
    if causal and tq == tk:
        is_causal = True
    elif causal and tq > 1:
        # SDPA's is_causal aligns top-left; a cached chunk of queries must see every earlier key.
        i = torch.arange(tq, device=q.device)[:, None]
        j = torch.arange(tk, device=q.device)[None, :]
        mask = j <= i + (tk - tq)
    # causal with tq == 1: the single (last) query sees all keys, no mask needed.
    if key_mask is not None and key_mask.ndim == 2:  # per-row padding [B, Tk], with the causal mask if any
        if is_causal:
            mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril()
            is_causal = False
        rows = key_mask[:, None, None, :]  # [B, 1, 1, Tk] against SDPA's [B, H, Tq, Tk]
        mask = rows if mask is None else rows & mask
    elif key_mask is not None:  # with causal, Tq == 1 (softmax_attn checks): no causal mask to combine
        mask = key_mask[None, :]  # SDPA takes [Tq, Tk] masks
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return o.transpose(1, 2)


def softmax_attn_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    doc_bounds: list[int] | None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as softmax_attn_naive; output [B, Tq, H, D] in q's dtype."""
    if doc_bounds is None:
        return _sdpa(q, k, v, scale, causal, key_mask)
    outs = [
        _sdpa(q[:, a:b], k[:, a:b], v[:, a:b], scale, causal)
        for a, b in itertools.pairwise(doc_bounds)
        if b > a
    ]
    return torch.cat(outs, dim=1)
