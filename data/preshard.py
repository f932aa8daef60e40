"""Pre-shard a (streamed) source into local parquet shards with a ``text`` column.

A single big file (each Long-Data-Collections file is one unsplittable shard) can only be split across ranks
record by record, so every rank decompresses the whole file. Pre-sharding once writes N parquet files that a
``files`` source then assigns round-robin to ranks::

    python -m data.preshard --paths 'hf://datasets/togethercomputer/Long-Data-Collections/pretrain/rp_sub.jsonl.zst' \\
        --out /data/ldc/rp_sub --num-shards 64
    python -m data.preshard --hub HuggingFaceFW/fineweb-edu --config sample-10BT --split train \\
        --out /data/fineweb --num-shards 64 --max-docs 1000000

then ``data.sources=[{type: files, paths: [/data/ldc/rp_sub/*.parquet], field: text}]``.

Documents are read with the same sources as training (one pass, malformed records skipped and counted) and
dealt round-robin: document i goes to shard ``i % num_shards``, written in row groups of ``--row-group-size``
rows. Shards are named ``shard-00000-of-00064.parquet`` and each appears atomically (written to a ``.tmp`` file,
then renamed), so an interrupted run leaves no truncated shard.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .sources import FilesSource, HubSource

SCHEMA = pa.schema([("text", pa.string())])


def _one_pass(source: FilesSource | HubSource) -> Iterator[str]:
    """Every document of ``source`` once (stops when the source would start its second epoch)."""
    while True:
        text = source.next_text()  # raises ValueError on a source without a single document
        if source.epoch > 0:
            return
        yield text


def preshard(source: FilesSource | HubSource, out_dir: str | Path, num_shards: int, row_group_size: int = 1000,
             max_docs: int | None = None) -> dict:
    """Write ``source``'s documents into ``num_shards`` parquet files in ``out_dir``; returns a summary dict."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [out_dir / f"shard-{k:05d}-of-{num_shards:05d}.parquet" for k in range(num_shards)]
    tmps = [n.with_name(n.name + ".tmp") for n in names]
    writers = [pq.ParquetWriter(str(t), SCHEMA) for t in tmps]
    pending: list[list[str]] = [[] for _ in range(num_shards)]
    rows = [0] * num_shards

    def flush(k: int) -> None:
        if pending[k]:
            writers[k].write_table(pa.table({"text": pending[k]}, schema=SCHEMA))
            rows[k] += len(pending[k])
            pending[k] = []

    n = 0
    try:
        for text in _one_pass(source):
            if max_docs is not None and n >= max_docs:
                break
            k = n % num_shards
            pending[k].append(text)
            if len(pending[k]) >= row_group_size:
                flush(k)
            n += 1
        for k in range(num_shards):
            flush(k)
    finally:
        for w in writers:
            w.close()
    for tmp, name in zip(tmps, names):
        os.replace(tmp, name)
    return {"docs": n, "shards": [str(p) for p in names], "rows_per_shard": rows,
            "malformed": source.stats["malformed"], "empty": source.stats["empty"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="Stream a files or hub source into N local parquet shards.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--paths", nargs="+", help="files/globs/URLs (hf://, local) of a files source")
    src.add_argument("--hub", metavar="NAME", help="HF dataset name for datasets.load_dataset(streaming=True)")
    p.add_argument("--config", default=None, help="hub dataset config name")
    p.add_argument("--split", default="train", help="hub dataset split")
    p.add_argument("--data-files", nargs="+", default=None, help="data_files for the hub builder (e.g. with json)")
    p.add_argument("--field", default="text", help="field/column holding the text")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--num-shards", type=int, required=True)
    p.add_argument("--row-group-size", type=int, default=1000)
    p.add_argument("--max-docs", type=int, default=None, help="stop after this many documents")
    a = p.parse_args(argv)
    if a.paths:
        source = FilesSource(a.paths, field=a.field)
    else:
        source = HubSource(a.hub, a.config, split=a.split, field=a.field, data_files=a.data_files)
    summary = preshard(source, a.out, a.num_shards, a.row_group_size, a.max_docs)
    print(json.dumps({k: v for k, v in summary.items() if k != "shards"}), f"-> {a.out}")
    return summary


if __name__ == "__main__":
    main()
