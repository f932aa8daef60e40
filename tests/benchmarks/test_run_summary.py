"""benchmarks/run_summary.py: a run's losses, and tokens/s and peak memory without the first logged window."""
import json

import pytest

from benchmarks.run_summary import summarize


def test_summary_skips_the_first_window(tmp_path):
    rows = [{"step": 5, "train/loss": 8.70291, "perf/tokens_per_s": 10.0, "perf/mem_peak_gib": 90.0},
            {"step": 10, "train/loss": 7.35, "perf/tokens_per_s": 100.0, "perf/mem_peak_gib": 30.0},
            {"step": 15, "train/loss": 6.5, "perf/tokens_per_s": 300.0, "perf/mem_peak_gib": 31.5},
            {"step": 15, "val/loss": 6.9}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = summarize(tmp_path, "ddp")
    assert line == "ddp: steps [5, 10, 15] losses [8.7029, 7.35, 6.5] | tokens/s 200 | peak GiB 31.50"


def test_a_run_without_metrics_is_named(tmp_path):
    with pytest.raises(SystemExit, match="logged no step"):
        summarize(tmp_path, "fsdp")
