"""The committed embedded corpus: train/held-out split, licence, and the build script's split rule."""

import json

import zstandard

from data.build_corpus import split_heldout
from data.sources import REPO_ROOT

CORPUS = REPO_ROOT / "data" / "corpus"


def records(path):
    raw = zstandard.ZstdDecompressor().decompress(path.read_bytes())
    return [json.loads(line) for line in raw.decode().splitlines()]


def test_committed_corpus_split():
    train = [r for k in range(4) for r in records(CORPUS / f"train-{k:05d}.jsonl.zst")]
    heldout = records(CORPUS / "heldout.jsonl.zst")
    assert all(set(r) == {"text", "source"} and r["source"].endswith(".rst.txt") for r in train + heldout)
    train_sources = {r["source"] for r in train}
    assert len(train_sources) == len(train) > 400
    assert not train_sources & {r["source"] for r in heldout}
    assert len(heldout) >= 30 and sum(len(r["text"]) > 45_000 for r in heldout) >= 24
    assert "library/stdtypes.rst.txt" in train_sources  # the longest stays in train
    assert "PYTHON SOFTWARE FOUNDATION LICENSE" in (CORPUS / "LICENSE").read_text()
    assert sum(p.stat().st_size for p in CORPUS.glob("*.zst")) < 5_000_000


def test_split_rule_is_deterministic_and_disjoint():
    docs = [(f"d{i:03d}.rst.txt", "x" * (1000 - i * 7 % 997)) for i in range(200)]
    train, heldout = split_heldout(docs, num_heldout_long=5, heldout_stride=10)
    again = split_heldout(list(reversed(docs)), num_heldout_long=5, heldout_stride=10)
    assert sorted(heldout) == sorted(again[1])
    assert sorted(train + heldout) == sorted(docs) and not {d for d, _ in train} & {d for d, _ in heldout}
    by_size = sorted(docs, key=lambda d: (-len(d[1]), d[0]))
    assert {d[0] for d in by_size[:15][1::3]} <= {d for d, _ in heldout}  # 5 of the 15 longest
    assert len(heldout) == 5 + len(range(10 // 2, 200 - 15, 10))  # plus every 10th of the other 185
