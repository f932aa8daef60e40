"""Softmax attention through the flash_attn package (optional: imported lazily, never required).

flash_attn >= 2.1 aligns causal masks bottom-right when Tq != Tk, as the public contract asks, and handles
GQA and packed documents (flash_attn_varlen_func) natively. fp16/bf16 on CUDA only.
"""

import importlib.util

import torch

# Looked up once at import: importlib is in dynamo's skip list, so a lookup per call broke every compiled
# Transformer block on CUDA (bf16 inputs reach this check; CPU calls stop before it).
_FLASH_ATTN_FOUND = importlib.util.find_spec("flash_attn") is not None


def flash_available() -> bool:
    """True when the flash_attn package can be imported (checked without importing it, when hilo is imported)."""
    return _FLASH_ATTN_FOUND


def softmax_attn_flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int | None,
) -> torch.Tensor:
    """Same contract as softmax_attn_naive; cu_seqlens stays on the device, max_seqlen is its longest segment."""
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    if cu_seqlens is None:
        return flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    o = flash_attn_varlen_func(
        q[0], k[0], v[0],
        cu_seqlens_q=cu, cu_seqlens_k=cu,
        max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
        softmax_scale=scale, causal=causal,
    )
    return o.unsqueeze(0)
