"""Packing checked against an independent definition: the concatenated document stream and its doc starts."""

import json
from itertools import pairwise

import pytest
import torch

from data import build_train_loader
from data.packing import IGNORE_INDEX, TokenBuffer, pack_varlen
from tests.data.helpers import ByteTokenizer, jsonl_lines, make_docs, write_jsonl

TOK = ByteTokenizer()


def stream_of(docs):
    """The concatenated stream (each doc + [eos]) and the set of positions where a document starts."""
    stream, starts = [], set()
    for d in docs:
        starts.add(len(stream))
        stream += TOK.encode(d) + [TOK.eos_id]
    return stream, starts


def corpus(tmp_path, n=40, max_len=90):
    docs = make_docs("p", n, max_len=max_len)
    write_jsonl(tmp_path / "a.jsonl.zst", jsonl_lines(docs), zst=True)
    return docs, {"sources": [{"type": "files", "paths": [str(tmp_path / "a.jsonl.zst")]}]}


@pytest.mark.parametrize("seq_len,batch_size", [(16, 3), (37, 2), (128, 1)])
def test_fixed_rows_are_the_stream(tmp_path, seq_len, batch_size):
    docs, cfg = corpus(tmp_path)
    stream, _ = stream_of(docs)
    stream = stream * 4  # the source cycles
    loader = build_train_loader({**cfg, "packing": "fixed"}, TOK, seq_len=seq_len, batch_size=batch_size)
    n = batch_size * seq_len
    for b in range(len(stream) // n - 1):
        batch = next(loader)
        assert set(batch) == {"input_ids", "labels"}
        assert batch["input_ids"].shape == (batch_size, seq_len) and batch["input_ids"].dtype == torch.long
        assert torch.equal(batch["labels"], batch["input_ids"])
        assert batch["input_ids"].flatten().tolist() == stream[b * n:(b + 1) * n]


@pytest.mark.parametrize("seq_len,batch_size", [(16, 3), (37, 2), (300, 2)])
def test_varlen_segments_positions_and_labels(tmp_path, seq_len, batch_size):
    docs, cfg = corpus(tmp_path, max_len=120)
    stream, starts = stream_of(docs)
    period = len(stream)
    stream = stream * 4
    starts = {s + k * period for s in starts for k in range(4)}
    loader = build_train_loader({**cfg, "packing": "varlen"}, TOK, seq_len=seq_len, batch_size=batch_size)
    n = batch_size * seq_len
    for b in range(len(stream) // n - 1):
        batch = next(loader)
        lo = b * n
        ids = stream[lo:lo + n]
        assert batch["input_ids"].shape == (1, n) and batch["input_ids"][0].tolist() == ids
        # Segments end at every document end and at every row boundary (multiple of seq_len), nowhere else.
        cuts = sorted({0, n} | {p - lo for p in starts if lo < p < lo + n} | set(range(0, n, seq_len)))
        assert batch["cu_seqlens"].tolist() == cuts and batch["cu_seqlens"].dtype == torch.long
        expected_pos = []
        for a, z in pairwise(cuts):
            expected_pos += list(range(z - a))
        assert batch["position_ids"][0].tolist() == expected_pos
        expected_labels = [IGNORE_INDEX if lo + i in starts else t for i, t in enumerate(ids)]
        assert batch["labels"][0].tolist() == expected_labels
        assert max(z - a for a, z in pairwise(cuts)) <= seq_len


def test_long_documents_split_across_rows(tmp_path):
    docs = ["x" * 50, "y" * 7]
    write_jsonl(tmp_path / "a.jsonl", jsonl_lines(docs))
    cfg = {"sources": [{"paths": [str(tmp_path / "a.jsonl")]}], "packing": "varlen"}
    batch = next(build_train_loader(cfg, TOK, seq_len=20, batch_size=3))
    # 51 tokens of doc 0 -> pieces 20 | 20 | 11, then doc 1 (8 tokens) starts at 51, then doc 0 again at 59.
    assert batch["cu_seqlens"].tolist() == [0, 20, 40, 51, 59, 60]
    labels = batch["labels"][0]
    assert (labels == IGNORE_INDEX).nonzero().flatten().tolist() == [0, 51, 59]


def test_token_buffer_state_roundtrip():
    buf = TokenBuffer()
    buf.push_document([1, 2, 3, 4, 5])
    buf.push_document([6, 7])
    assert buf.take(3) == [([1, 2, 3], True)]
    sd = json.loads(json.dumps(buf.state_dict()))
    other = TokenBuffer()
    other.load_state_dict(sd)
    assert other.num_tokens == 4
    assert other.take(4) == [([4, 5], False), ([6, 7], True)]
    with pytest.raises(ValueError):
        other.take(1)


def test_pack_varlen_small_example():
    out = pack_varlen([[([5, 6], False), ([7, 8, 9], True)], [([10, 11, 12, 13, 14], True)]])
    assert out["cu_seqlens"].tolist() == [0, 2, 5, 10]
    assert out["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0, 1, 2, 3, 4]]
    assert out["labels"].tolist() == [[5, 6, -100, 8, 9, -100, 11, 12, 13, 14]]


def test_unknown_packing_and_empty_config(tmp_path):
    _, cfg = corpus(tmp_path, n=3)
    with pytest.raises(ValueError, match="unknown data.packing 'ragged'"):
        build_train_loader({**cfg, "packing": "ragged"}, TOK, seq_len=8, batch_size=1)
    with pytest.raises(ValueError, match="no `sources`"):
        build_train_loader({"sources": []}, TOK, seq_len=8, batch_size=1)
