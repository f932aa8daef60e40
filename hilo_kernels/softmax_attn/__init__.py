"""Causal softmax attention with GQA and packed documents (`softmax_attn`, docs/kernels.md).

Backends: "flash" (the flash_attn package, when importable; CUDA, fp16/bf16), "sdpa" (torch
scaled_dot_product_attention), "naive" (explicit masked softmax in fp32: the test oracle).
"""

import itertools

import torch

from .flash import flash_available, softmax_attn_flash
from .naive import softmax_attn_naive
from .sdpa import softmax_attn_sdpa

BACKENDS = ("flash", "sdpa", "naive")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

__all__ = ["BACKENDS", "softmax_attn"]


def _check_inputs(q, k, v, causal, cu_seqlens) -> list[int] | None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"softmax_attn: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(f"softmax_attn: {name} must be 4-D [B, T, H, D], got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"softmax_attn: {name} must be float32, float16 or bfloat16, got {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"softmax_attn: k and v must have the same shape [B, Tk, Hkv, D], got "
                         f"k {tuple(k.shape)} and v {tuple(v.shape)}")
    b, tq, h, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"softmax_attn: expected k/v of shape [B={b}, Tk, Hkv, D={d}] to match q "
                         f"{tuple(q.shape)}, got {tuple(k.shape)}")
    hkv = k.shape[2]
    if hkv == 0 or h % hkv != 0:
        raise ValueError(f"softmax_attn: q heads ({h}) must be a multiple of k/v heads ({hkv}) for GQA")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"softmax_attn: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"softmax_attn: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    tk = k.shape[1]
    if causal and tq > tk:
        raise ValueError(f"softmax_attn: causal attention needs Tq <= Tk (queries are the last Tq positions), "
                         f"got Tq={tq}, Tk={tk}")
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.ndim != 1 or cu_seqlens.dtype not in (
        torch.int32, torch.int64
    ):
        raise TypeError("softmax_attn: cu_seqlens must be a 1-D int32/int64 tensor [N+1] of document boundaries")
    if b != 1:
        raise ValueError(f"softmax_attn: cu_seqlens needs packed inputs with B == 1, got B={b}")
    if tq != tk:
        raise ValueError(f"softmax_attn: cu_seqlens needs Tq == Tk (no cache), got Tq={tq}, Tk={tk}")
    bounds = cu_seqlens.tolist()
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != tq or any(
        x > y for x, y in itertools.pairwise(bounds)
    ):
        raise ValueError(f"softmax_attn: cu_seqlens must be non-decreasing from 0 to T={tq}, got {bounds}")
    return bounds


def _check_key_mask(key_mask, q, k, causal, cu_seqlens) -> None:
    b, tk = k.shape[:2]
    if not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool or key_mask.shape not in (
        (tk,), (b, tk)
    ):
        got = f"{key_mask.dtype} {tuple(key_mask.shape)}" if isinstance(key_mask, torch.Tensor) else type(key_mask)
        raise ValueError(f"softmax_attn: key_mask must be a bool tensor [Tk={tk}] or [B={b}, Tk={tk}], got {got}")
    if key_mask.device != k.device:
        raise ValueError(f"softmax_attn: key_mask is on {key_mask.device}, k on {k.device}")
    if cu_seqlens is not None:
        raise ValueError("softmax_attn: key_mask (a preallocated cache) cannot be combined with cu_seqlens")
    if causal and q.shape[1] != 1 and key_mask.ndim == 1:
        raise ValueError(f"softmax_attn: key_mask with causal=True takes one query (a decoding step), got Tq="
                         f"{q.shape[1]}; pass the filled keys without key_mask, or causal=False")


def softmax_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """o = softmax(scale * q k^T + mask) v, per head; returns o [B, Tq, H, D] in q's dtype.

    q [B, Tq, H, D]; k, v [B, Tk, Hkv, D] with H % Hkv == 0 (query head h reads k/v head h // (H / Hkv)).
    scale defaults to D ** -0.5. causal: query i sees keys j <= Tk - Tq + i (bottom-right alignment, so a
    decoding step with a KV cache sees the whole cache). cu_seqlens: int tensor [N+1] of document boundaries
    with B == 1 and Tq == Tk; no query attends to a key of another document.
    key_mask: bool [Tk], True for the keys that hold tokens (a preallocated KV cache whose first positions are
    filled: the compiled decoding step reads whole buffers). With causal=True it needs Tq == 1 (bottom-right
    alignment would place several queries at the buffer's end, not after its filled prefix). Or bool [B, Tk]:
    per row, the keys that are tokens and not padding (a padded batch's KV cache), combined with the causal mask
    for any Tq; every query must see at least one key. Backend sdpa or naive (None picks sdpa).
    backend: "flash", "sdpa" or "naive"; None picks flash when importable on CUDA with fp16/bf16 inputs and
    D <= 256, else sdpa.
    """
    bounds = _check_inputs(q, k, v, causal, cu_seqlens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if key_mask is not None:
        _check_key_mask(key_mask, q, k, causal, cu_seqlens)
        if backend == "flash":
            raise ValueError("softmax_attn: key_mask needs backend 'sdpa' or 'naive' (flash_attn takes no key mask)")
        backend = backend or "sdpa"
    if backend is None:
        use_flash = (
            q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and flash_available()
        )
        backend = "flash" if use_flash else "sdpa"
    if backend == "naive":
        return softmax_attn_naive(q, k, v, scale, causal, bounds, key_mask)
    if backend == "sdpa":
        return softmax_attn_sdpa(q, k, v, scale, causal, bounds, key_mask)
    if backend == "flash":
        if not flash_available():
            raise RuntimeError("softmax_attn: backend='flash' needs the flash_attn package; install it or use "
                               "backend='sdpa'")
        if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"softmax_attn: backend='flash' needs CUDA fp16/bf16 inputs, got {q.dtype} on "
                             f"{q.device}")
        max_seqlen = None if bounds is None else max(b - a for a, b in itertools.pairwise(bounds))
        return softmax_attn_flash(q, k, v, scale, causal, cu_seqlens, max_seqlen)
    raise ValueError(f"softmax_attn: unknown backend {backend!r}; expected one of {BACKENDS} or None")
