"""Per-rank hashes of the token rows each rank trains on (trainer.data_hashes), and the check that ranks differ.

With trainer.data_hashes=true every rank appends one JSON line per micro batch to
run_dir/data_hashes/rank{r:05d}.jsonl: {"step": optimizer step about to run, "micro": micro step, "rows": [SHA-1 of
each row's token ids]}. The rows are copied to the host for this (a diagnostic, off by default).

    python -m training.data_hashes RUN_DIR      # rows per rank, rows shared by two ranks; exit status 1 if any
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch


class DataHashWriter:
    """Appends the SHA-1 of each row of a rank's batches to run_dir/data_hashes/rank{rank:05d}.jsonl."""

    def __init__(self, run_dir: str | Path, rank: int):
        self.path = Path(run_dir) / "data_hashes" / f"rank{rank:05d}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, micro: int, input_ids: torch.Tensor) -> None:
        rows = input_ids.detach().to("cpu", torch.int64).reshape(input_ids.shape[0], -1).numpy()
        digests = [hashlib.sha1(row.tobytes()).hexdigest() for row in rows]
        with self.path.open("a") as fh:
            fh.write(json.dumps({"step": step, "micro": micro, "rows": digests}) + "\n")


def read_hashes(run_dir: str | Path) -> dict[int, list[dict]]:
    """{rank: its records in file order} from run_dir/data_hashes/ (FileNotFoundError naming the fix if none)."""
    folder = Path(run_dir) / "data_hashes"
    files = sorted(folder.glob("rank*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no data hashes under {folder}: train with trainer.data_hashes=true first")
    out = {}
    for f in files:
        rank = int(f.stem.removeprefix("rank"))
        records = []
        for n, line in enumerate(f.read_text().splitlines(), 1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{f}:{n}: not a JSON record ({e}); the file is damaged") from e
        out[rank] = records
    return out


def cross_rank_overlap(hashes: dict[int, list[dict]]) -> dict:
    """{"rows": {rank: rows hashed}, "distinct": {rank: distinct rows}, "shared": rows seen by two or more ranks}."""
    seen: dict[str, set[int]] = {}
    rows, distinct = {}, {}
    for rank, records in hashes.items():
        mine = [h for r in records for h in r["rows"]]
        rows[rank], distinct[rank] = len(mine), len(set(mine))
        for h in set(mine):
            seen.setdefault(h, set()).add(rank)
    return {"rows": rows, "distinct": distinct, "shared": sum(len(r) > 1 for r in seen.values())}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m training.data_hashes RUN_DIR", file=sys.stderr)
        return 2
    report = cross_rank_overlap(read_hashes(argv[0]))
    for rank in sorted(report["rows"]):
        print(f"rank {rank}: {report['rows'][rank]} rows, {report['distinct'][rank]} distinct")
    print(f"rows seen by more than one rank: {report['shared']}")
    return 1 if report["shared"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
