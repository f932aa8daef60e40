"""Padded batches: an attention_mask with zeros turned into packed documents (docs/design.md, "Padded batches").

A forward over padded rows [B, T] runs as one packed row [1, N] of the N real tokens with cu_seqlens [B+1] (row b
is document b), so every mixer takes its varlen path: no state, conv tap or attention score crosses from one row
into another or reads a pad, and positions restart at each row's first real token. Outputs go back to the padded
layout (zeros at the pads). With a decoding cache, the packed prefill leaves each row's own final states in the
cache's batch rows, and attention layers keep their keys and values in the padded layout, which later steps read
with the mask's columns as a key mask.
"""

from typing import NamedTuple

import torch


class Unpadded(NamedTuple):
    """Where the real tokens of a padded batch [batch, seq_len] sit: indices [N] into the flattened batch
    (b * seq_len + t, in row order) and cu_seqlens [batch + 1] (int32) of the rows' lengths once packed."""

    indices: torch.Tensor
    cu_seqlens: torch.Tensor
    batch: int
    seq_len: int


def unpad_mask(mask: torch.Tensor) -> Unpadded:
    """The packing of a 0/1 (or bool) attention_mask [B, T]: its nonzero entries, row by row, as documents (a
    row of zeros is an empty document). Reads the number of real tokens on the host (a synchronisation)."""
    real = mask.bool()
    b, t = real.shape
    indices = real.reshape(-1).nonzero().squeeze(1)
    if indices.numel() == 0:
        raise ValueError("attention_mask has no real token (every entry is 0): nothing to run")
    cu_seqlens = torch.zeros(b + 1, dtype=torch.int32, device=mask.device)
    cu_seqlens[1:] = real.sum(1).cumsum(0)
    return Unpadded(indices, cu_seqlens, b, t)


def unpad(x: torch.Tensor, u: Unpadded) -> torch.Tensor:
    """x [B, T, ...] -> [1, N, ...]: the real tokens, packed row after row."""
    return x.reshape(u.batch * u.seq_len, *x.shape[2:]).index_select(0, u.indices).unsqueeze(0)


def pad(x: torch.Tensor, u: Unpadded) -> torch.Tensor:
    """[1, N, ...] -> [B, T, ...]: each packed token back at its row and column, zeros at the pads."""
    out = x.new_zeros(u.batch * u.seq_len, *x.shape[2:])
    return out.index_copy(0, u.indices, x[0]).view(u.batch, u.seq_len, *x.shape[2:])


def mask_positions(mask: torch.Tensor, t: int) -> torch.Tensor:
    """[B, t] positions of the last t columns of mask [B, S]: the number of real tokens before each one in its row
    (a pad gets its row's next position, which nothing reads)."""
    return (mask.long().cumsum(-1)[:, -t:] - 1).clamp(min=0)


def target_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [B, T]: where a label of mask [B, T] is a next-token target of the row's own tokens (real, and its
    predecessor real as well): with left padding the first real token follows a pad, whose output is not the row's
    and predicts nothing; a row's first token is never a target, as when the row runs alone."""
    real = mask.bool()
    return real & torch.cat([torch.zeros_like(real[:, :1]), real[:, :-1]], dim=1)
