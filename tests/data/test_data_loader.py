import io
import json

import pytest
import torch

from data import build_train_loader, iter_heldout_documents
from tests.data.helpers import ByteTokenizer, jsonl_lines, make_docs, write_jsonl, write_parquet

TOK = ByteTokenizer()


def mixed_cfg(tmp_path, packing, with_hub=False):
    """Three sources: 3 jsonl.zst files (with malformed lines), one parquet file, optionally a hub source."""
    for k in range(3):
        lines = jsonl_lines(make_docs(f"a{k}_", 9, seed=k, max_len=150))
        lines.insert(4, "{broken")
        write_jsonl(tmp_path / f"a{k}.jsonl.zst", lines, zst=True)
    write_parquet(tmp_path / "b.parquet", make_docs("b", 11, seed=5, max_len=60), row_group_size=3)
    sources = [{"type": "files", "paths": [str(tmp_path / "a*.jsonl.zst")], "weight": 0.6},
               {"type": "files", "paths": [str(tmp_path / "b.parquet")], "weight": 0.4}]
    if with_hub:
        write_jsonl(tmp_path / "h.jsonl", jsonl_lines(make_docs("h", 8, seed=3)))
        sources.append({"type": "hub", "name": "json", "data_files": [str(tmp_path / "h.jsonl")], "weight": 0.3})
    return {"sources": sources, "packing": packing}


def batches(loader, n):
    return [next(loader) for _ in range(n)]


def assert_same(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("packing", ["fixed", "varlen"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_is_exact(tmp_path, packing, world_size):
    cfg = mixed_cfg(tmp_path, packing)
    kw = {"seq_len": 24, "batch_size": 3, "world_size": world_size, "seed": 7}
    for rank in range(world_size):
        reference = batches(build_train_loader(cfg, TOK, rank=rank, **kw), 30)  # several epochs of each source
        for k in (1, 5, 13):
            first = build_train_loader(cfg, TOK, rank=rank, **kw)
            head = batches(first, k)
            sd = json.loads(json.dumps(first.state_dict()))  # JSON-serialisable
            buf = io.BytesIO()
            torch.save(first.state_dict(), buf)  # and torch.save-able
            buf.seek(0)
            assert torch.load(buf, weights_only=True) == sd
            resumed = build_train_loader(cfg, TOK, rank=rank, **kw)
            resumed.load_state_dict(sd)
            assert_same(head + batches(resumed, 30 - k), reference)
            assert resumed.stats["batches"] == 30
        assert first.stats["malformed"] > 0


def test_resume_with_hub_source(tmp_path):
    cfg = mixed_cfg(tmp_path, "varlen", with_hub=True)
    kw = {"seq_len": 20, "batch_size": 2, "world_size": 2, "rank": 1, "seed": 3}
    reference = batches(build_train_loader(cfg, TOK, **kw), 25)
    first = build_train_loader(cfg, TOK, **kw)
    head = batches(first, 11)
    sd = json.loads(json.dumps(first.state_dict()))
    assert first.stats["sources"][2]["docs"] > 0
    resumed = build_train_loader(cfg, TOK, **kw)
    resumed.load_state_dict(sd)
    assert_same(head + batches(resumed, 14), reference)


def test_ranks_read_distinct_data(tmp_path):
    cfg = mixed_cfg(tmp_path, "fixed")
    rows = [torch.cat([b["input_ids"] for b in batches(
        build_train_loader(cfg, TOK, seq_len=32, batch_size=2, rank=r, world_size=2), 10)]).tolist()
        for r in range(2)]
    text = [TOK.decode([t for row in r for t in row if t != TOK.eos_id]) for r in rows]
    # files a0,a2 go to rank 0 and a1 to rank 1; b.parquet is strided by record
    assert "<a0_" in text[0] and "<a1_" not in text[0] and "<a1_" in text[1] and "<a0_" not in text[1]
    assert "<b0>" in text[0] and "<b0>" not in text[1] and "<b1>" in text[1]


def test_mixing_follows_weights(tmp_path):
    for k, name in enumerate("xyz"):
        write_jsonl(tmp_path / f"{name}.jsonl", jsonl_lines([f"{name}{i:03d}" for i in range(50)]))
    cfg = {"sources": [{"paths": [str(tmp_path / "x.jsonl")], "weight": 3.0},
                       {"paths": [str(tmp_path / "y.jsonl")], "weight": 1.0},
                       {"paths": [str(tmp_path / "z.jsonl")], "weight": 0.0}]}
    loader = build_train_loader(cfg, TOK, seq_len=50, batch_size=4, seed=0)
    batches(loader, 100)  # 20000 tokens, 5 tokens per document -> ~4000 documents
    docs = [s["docs"] for s in loader.stats["sources"]]
    assert docs[2] == 0 and sum(docs) > 3900
    assert abs(docs[0] / sum(docs) - 0.75) < 0.03
    assert loader.stats["sources"][0]["epochs_completed"] > 10  # sources cycle
    other_seed = build_train_loader(cfg, TOK, seq_len=50, batch_size=4, seed=1)
    assert not torch.equal(next(other_seed)["input_ids"], next(build_train_loader(
        cfg, TOK, seq_len=50, batch_size=4, seed=0))["input_ids"])


def test_state_mismatch_is_refused(tmp_path):
    cfg = mixed_cfg(tmp_path, "fixed")
    sd = build_train_loader(cfg, TOK, seq_len=8, batch_size=1, rank=0, world_size=2).state_dict()
    with pytest.raises(ValueError, match="rank 0/2 given to rank 1/2"):
        build_train_loader(cfg, TOK, seq_len=8, batch_size=1, rank=1, world_size=2).load_state_dict(sd)


def test_fully_malformed_source_raises_in_loader(tmp_path):
    write_jsonl(tmp_path / "bad.jsonl", ["{x"] * 5)
    loader = build_train_loader({"sources": [{"paths": [str(tmp_path / "bad.jsonl")]}]}, TOK, seq_len=8,
                                batch_size=1)
    with pytest.raises(ValueError, match="all 5 records"):
        next(loader)


def test_heldout_documents(tmp_path):
    docs = ["short", "a" * 40, "{bad", "b" * 100, "c" * 39, "d" * 60]
    write_jsonl(tmp_path / "h.jsonl", jsonl_lines(docs[:2]) + ["{bad"] + jsonl_lines(docs[3:]))
    cfg = {"heldout": str(tmp_path / "h.jsonl")}
    got = list(iter_heldout_documents(cfg, TOK, min_tokens=40, max_docs=None))
    assert got == [TOK.encode("a" * 40), TOK.encode("b" * 100), TOK.encode("d" * 60)]
    assert list(iter_heldout_documents(cfg, TOK, min_tokens=40, max_docs=2)) == got[:2]
    parquet_cfg = {"heldout": {"type": "files", "paths": [str(write_parquet(tmp_path / "h.parquet", ["e" * 50],
                                                                             field="body"))], "field": "body"}}
    assert list(iter_heldout_documents(parquet_cfg, TOK, 10, None)) == [TOK.encode("e" * 50)]
    with pytest.raises(ValueError, match="no held-out document.*>= 1000 tokens"):
        list(iter_heldout_documents(cfg, TOK, min_tokens=1000, max_docs=None))
    with pytest.raises(FileNotFoundError):
        list(iter_heldout_documents({"heldout": str(tmp_path / "missing.jsonl")}, TOK, 1, None))


def test_heldout_from_hub_source(tmp_path):
    write_jsonl(tmp_path / "h.jsonl", jsonl_lines(["x" * 30, "y" * 5, "z" * 31]))
    cfg = {"heldout": {"type": "hub", "name": "json", "data_files": [str(tmp_path / "h.jsonl")]}}
    assert list(iter_heldout_documents(cfg, TOK, 30, None)) == [TOK.encode("x" * 30), TOK.encode("z" * 31)]
