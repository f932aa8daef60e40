"""Fixture writers and an independent byte-level tokenizer for the data tests."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard


class ByteTokenizer:
    """UTF-8 bytes shifted by 3 (0 bos, 1 eos, 2 unused): trivially correct, so tests check the loader only."""

    bos_id, eos_id, vocab_size, name = 0, 1, 259, "bytes"

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8")


def make_docs(prefix: str, n: int, seed: int = 0, max_len: int = 90) -> list[str]:
    """n distinct documents of varied length (some longer than the rows used in tests)."""
    out = []
    for i in range(n):
        length = 1 + (i * 37 + seed * 11) % max_len
        out.append(f"<{prefix}{i}>" + "".join(chr(97 + (i + j) % 26) for j in range(length)))
    return out


def jsonl_lines(texts, field="text") -> list[str]:
    return [json.dumps({field: t, "id": i}) for i, t in enumerate(texts)]


def write_jsonl(path: Path, lines: list[str], zst: bool = False, frames: int = 1) -> Path:
    """Write lines (already serialised) as .jsonl, or .jsonl.zst split into ``frames`` zstd frames."""
    payload = "".join(line + "\n" for line in lines).encode()
    if zst:
        cut = [len(payload) * k // frames for k in range(frames + 1)]
        c = zstandard.ZstdCompressor(level=3)
        payload = b"".join(c.compress(payload[a:b]) for a, b in pairwise(cut))
    path.write_bytes(payload)
    return path


def write_parquet(path: Path, texts, field="text", row_group_size=4) -> Path:
    pq.write_table(pa.table({field: texts}), str(path), row_group_size=row_group_size)
    return path
