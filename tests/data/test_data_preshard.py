import json
import subprocess
import sys

import pyarrow.parquet as pq

from data.preshard import main, preshard
from data.sources import REPO_ROOT, FilesSource, build_source
from tests.data.helpers import jsonl_lines, make_docs, write_jsonl


def read_all(pattern):
    src, out = FilesSource(pattern), []
    while True:
        text = src.next_text()
        if src.epoch:
            return out
        out.append(text)


def test_preshard_roundtrip_files_source(tmp_path):
    docs = make_docs("d", 53)
    write_jsonl(tmp_path / "in0.jsonl.zst", jsonl_lines(docs[:30]) + ["{bad"], zst=True)
    write_jsonl(tmp_path / "in1.jsonl.zst", jsonl_lines(docs[30:]), zst=True)
    summary = main(["--paths", str(tmp_path / "in*.jsonl.zst"), "--out", str(tmp_path / "out"),
                    "--num-shards", "4", "--row-group-size", "5"])
    assert summary["docs"] == 53 and summary["malformed"] == 1 and sum(summary["rows_per_shard"]) == 53
    shards = sorted((tmp_path / "out").glob("*.parquet"))
    assert [s.name for s in shards] == [f"shard-{k:05d}-of-00004.parquet" for k in range(4)]
    assert not list((tmp_path / "out").glob("*.tmp"))
    for k, shard in enumerate(shards):  # round-robin: document i in shard i % 4
        table = pq.read_table(shard)
        assert table.column_names == ["text"] and table.column("text").to_pylist() == docs[k::4]
        assert pq.ParquetFile(shard).metadata.num_row_groups == 3  # 14 or 13 rows in groups of 5
    # the shards are a files source: with 2 ranks each reads 2 whole shards, together everything once
    ranks = [read_all_rank(tmp_path / "out" / "*.parquet", r) for r in range(2)]
    assert sorted(ranks[0] + ranks[1]) == sorted(docs) and not set(ranks[0]) & set(ranks[1])


def read_all_rank(pattern, rank):
    src, out = FilesSource(str(pattern), rank=rank, world_size=2), []
    assert src.sharding == "files"
    while True:
        text = src.next_text()
        if src.epoch:
            return out
        out.append(text)


def test_preshard_hub_source_and_max_docs(tmp_path):
    docs = make_docs("h", 20)
    write_jsonl(tmp_path / "h.jsonl", jsonl_lines(docs))
    source = build_source({"type": "hub", "name": "json", "data_files": [str(tmp_path / "h.jsonl")]})
    summary = preshard(source, tmp_path / "out", num_shards=3, max_docs=11)
    assert summary["docs"] == 11
    assert read_all(str(tmp_path / "out" / "*.parquet")) == [d for k in range(3) for d in docs[:11][k::3]]


def test_cli_module_entry_point(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", jsonl_lines(["one", "two", "three"]))
    out = subprocess.run([sys.executable, "-m", "data.preshard", "--paths", str(tmp_path / "a.jsonl"), "--out",
                          str(tmp_path / "o"), "--num-shards", "2"], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert json.loads(out.split(" -> ")[0])["docs"] == 3
    assert read_all(str(tmp_path / "o" / "*.parquet")) == ["one", "three", "two"]
