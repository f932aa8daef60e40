"""cu_seqlens -> per-sequence bounds and per-chunk tables, computed on the tensors' device.

A chunk never crosses a document boundary: document n (tokens cu[n]..cu[n+1]) is cut into ceil(len/C)
chunks starting at cu[n]. Chunk c of the whole packed batch is numbered in document order. The number of
chunks depends on the values of cu_seqlens, so the table has a static upper bound of rows,
cdiv(T, C) + N, and rows past the real count are empty (start == end); no host synchronisation.
"""

import torch


def sequence_bounds(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int, device) -> torch.Tensor:
    """int64 [N+1] document boundaries over the flattened [B*T] token axis (cu_seqlens, or b*T)."""
    if cu_seqlens is not None:
        return cu_seqlens.to(device=device, dtype=torch.int64)
    return torch.arange(batch + 1, device=device, dtype=torch.int64) * seqlen


def chunk_table(bounds: torch.Tensor, total_tokens: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk table for boundaries `bounds` [N+1] (int64, on device).

    Returns (table, chunk_offsets): table int32 [cdiv(total_tokens, chunk) + N, 3] of (start, end, seq) per
    chunk in document order, empty rows (start == end == 0, seq 0) at the tail; chunk_offsets int32 [N+1],
    the index of each document's first chunk (chunk_offsets[N] = number of real chunks).
    """
    n = bounds.numel() - 1
    lens = bounds[1:] - bounds[:-1]
    nchunks = (lens + chunk - 1) // chunk
    offsets = torch.cat((nchunks.new_zeros(1), torch.cumsum(nchunks, 0)))
    rows = (total_tokens + chunk - 1) // chunk + n
    c = torch.arange(rows, device=bounds.device, dtype=torch.int64)
    # offsets[0] = 0 <= c: searching all of offsets counts one more than searching offsets[1:] would (inductor's
    # searchsorted failed to lower a sliced boundary tensor ("SliceView") in a compiled GDN block on torch 2.11)
    seq = (torch.searchsorted(offsets, c, right=True) - 1).clamp_(max=max(n - 1, 0))
    start = bounds[seq] + (c - offsets[seq]) * chunk
    end = torch.minimum(start + chunk, bounds[seq + 1])
    valid = c < offsets[n]
    start = torch.where(valid, start, torch.zeros_like(start))
    end = torch.where(valid, end, torch.zeros_like(end))
    seq = torch.where(valid, seq, torch.zeros_like(seq))
    table = torch.stack([start, end, seq], dim=1).to(torch.int32).contiguous()
    return table, offsets.to(torch.int32)
