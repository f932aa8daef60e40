"""Packing a stream of tokenized documents into fixed-size training rows.

The stream is the concatenation of documents, each ``tokens + [eos]``. ``TokenBuffer`` holds the part of the
stream not yet emitted as *pieces* ``(tokens, starts_document)``: a document cut at a row boundary continues
in the next row as a piece with ``starts_document=False``. Rows of ``seq_len`` tokens are taken from the front
of the buffer in stream order, so no token is lost or repeated.

Two batch layouts:

- fixed: ``input_ids`` and ``labels`` ``[B, T]`` (labels == input_ids; the model shifts them). Attention
  runs across document boundaries inside a row; EOS marks the boundary.
- varlen: the B rows laid end to end in one row ``[1, B*T]`` with ``cu_seqlens`` ``[N+1]`` (int64): one segment
  per piece, where pieces end at document ends and at every multiple of T, so no segment is longer than T and
  nothing attends across a document. ``position_ids`` restart at 0 in every segment. ``labels`` are
  ``input_ids`` except -100 at each document's first token: in the shifted loss that token would be predicted
  from the previous document. The first token of a continuation piece keeps its label (its predecessor
  belongs to the same document).
"""

from __future__ import annotations

from collections import deque

import torch

IGNORE_INDEX = -100
Piece = tuple[list[int], bool]


class TokenBuffer:
    """FIFO of document pieces; ``num_tokens`` is the total length of the pieces held."""

    def __init__(self):
        self.pieces: deque[Piece] = deque()
        self.num_tokens = 0

    def push_document(self, tokens: list[int]) -> None:
        if tokens:
            self.pieces.append((list(tokens), True))
            self.num_tokens += len(tokens)

    def take(self, n: int) -> list[Piece]:
        """Remove and return the first ``n`` tokens as pieces (the last one possibly cut)."""
        if n > self.num_tokens:
            raise ValueError(f"buffer holds {self.num_tokens} tokens, {n} requested")
        out: list[Piece] = []
        while n:
            tokens, starts = self.pieces.popleft()
            if len(tokens) > n:
                self.pieces.appendleft((tokens[n:], False))
                tokens = tokens[:n]
            out.append((tokens, starts))
            n -= len(tokens)
            self.num_tokens -= len(tokens)
        return out

    def state_dict(self) -> dict:
        return {"pieces": [[list(t), bool(s)] for t, s in self.pieces]}

    def load_state_dict(self, sd: dict) -> None:
        self.pieces = deque((list(map(int, t)), bool(s)) for t, s in sd["pieces"])
        self.num_tokens = sum(len(t) for t, _ in self.pieces)


def pack_fixed(rows: list[list[Piece]]) -> dict[str, torch.Tensor]:
    """B rows of pieces (each row T tokens) -> {"input_ids", "labels"} LongTensors [B, T]."""
    input_ids = torch.tensor([[tok for tokens, _ in row for tok in tokens] for row in rows], dtype=torch.long)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def pack_varlen(rows: list[list[Piece]]) -> dict[str, torch.Tensor]:
    """B rows of pieces -> {"input_ids", "labels", "position_ids"} [1, B*T] and "cu_seqlens" [N+1] (int64)."""
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    cu_seqlens = [0]
    for row in rows:
        for tokens, starts in row:
            ids.extend(tokens)
            labels.extend(tokens)
            if starts:
                labels[len(ids) - len(tokens)] = IGNORE_INDEX
            positions.extend(range(len(tokens)))
            cu_seqlens.append(len(ids))
    as_row = lambda x: torch.tensor(x, dtype=torch.long).unsqueeze(0)
    return {"input_ids": as_row(ids), "labels": as_row(labels), "position_ids": as_row(positions),
            "cu_seqlens": torch.tensor(cu_seqlens, dtype=torch.long)}


PACKERS = {"fixed": pack_fixed, "varlen": pack_varlen}


def ignore_row_tails(batch: dict[str, torch.Tensor], ends: dict[int, int], seq_len: int) -> None:
    """In place: the labels of row r from token ``ends[r]`` to its end set to IGNORE_INDEX, in either layout
    (fixed ``[B, T]`` or varlen ``[1, B*T]``, row r at ``[r*T, (r+1)*T)``); the padding after a needle document."""
    labels = batch["labels"]
    for row, end in ends.items():
        if "cu_seqlens" in batch:
            labels[0, row * seq_len + end:(row + 1) * seq_len] = IGNORE_INDEX
        else:
            labels[row, end:] = IGNORE_INDEX
