"""Definitional softmax attention in fp32: the test oracle.

Builds the full [Tq, Tk] score matrix per head, masks it explicitly and normalizes with softmax, so every
rule (causal bottom-right alignment, GQA head grouping, document boundaries) is visible in one place.
"""

import itertools

import torch


def attention_mask(
    tq: int, tk: int, causal: bool, doc_bounds: list[int] | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean [Tq, Tk] mask, True where query i may attend to key j; None when every pair is allowed.

    causal: j <= i + (Tk - Tq) (bottom-right alignment: the last query sees every key).
    doc_bounds (cu_seqlens as a list, Tq == Tk): i and j must lie in the same document.
    """
    mask = None
    if causal:
        i = torch.arange(tq, device=device)[:, None]
        j = torch.arange(tk, device=device)[None, :]
        mask = j <= i + (tk - tq)
    if doc_bounds is not None:
        lengths = torch.tensor([b - a for a, b in itertools.pairwise(doc_bounds)], device=device)
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
        same_doc = doc[:, None] == doc[None, :]
        mask = same_doc if mask is None else mask & same_doc
    return mask


def softmax_attn_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    doc_bounds: list[int] | None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """o[b, i, h] = sum_j softmax_j(scale * q[b, i, h] . k[b, j, h // G]) v[b, j, h // G] over allowed j.

    q [B, Tq, H, D], k/v [B, Tk, Hkv, D], G = H / Hkv; key_mask [Tk] or [B, Tk] (bool) drops the keys where it is False. Computed in fp32, returned in q's dtype.
    """
    out_dtype = q.dtype
    groups = q.shape[2] // k.shape[2]
    qf, kf, vf = q.float(), k.float(), v.float()
    if groups > 1:
        kf = kf.repeat_interleave(groups, dim=2)
        vf = vf.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", qf, kf) * scale
    mask = attention_mask(q.shape[1], k.shape[1], causal, doc_bounds, q.device)
    if key_mask is not None:  # only the keys that hold tokens ([Tk], or [B, Tk] per row)
        keys = key_mask[None, :] if key_mask.ndim == 1 else key_mask[:, None, None, :]
        mask = keys if mask is None else mask & keys
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhij,bjhd->bihd", probs, vf).to(out_dtype)
