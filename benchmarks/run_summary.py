"""One line per training run from its metrics.jsonl: the logged losses, and the mean tokens/s and the peak memory
over the logged windows after the first (which holds compilation and warm-up). For comparing runs of one setting,
such as one GPU, DDP and FSDP at the same global batch.

    python benchmarks/run_summary.py RUN_DIR [NAME]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.logging import read_metrics


def summarize(run_dir: Path, name: str) -> str:
    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    if not rows:
        raise SystemExit(f"{run_dir}/metrics.jsonl is missing or empty: the run logged no step")
    train = [r for r in rows if "train/loss" in r]
    perf = [r for r in rows if "perf/tokens_per_s" in r][1:]
    line = f"{name}: steps {[r.get('step') for r in train]} losses {[round(r['train/loss'], 4) for r in train]}"
    if perf:
        tokens = sum(r["perf/tokens_per_s"] for r in perf) / len(perf)
        peak = max(r.get("perf/mem_peak_gib", 0.0) for r in perf)
        line += f" | tokens/s {tokens:.0f} | peak GiB {peak:.2f}"
    return line


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__)
    print(summarize(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) == 3 else Path(sys.argv[1]).name))
