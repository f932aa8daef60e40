"""benchmarks/mqar_sweep.py on CPU: two tiny points at once, their table and throughput, and a re-run that skips them."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import mqar_sweep

TINY = ["trainer.max_steps=3", "trainer.batch_size=4", "trainer.val_every=2", "trainer.seq_len=32", "logger=none",
        "trainer.device=cpu", "data.train=[{seq_len:32,num_kv_pairs:2,num_examples:16}]",
        "data.test=[{seq_len:32,num_kv_pairs:2,num_examples:8}]"]


def test_grid_runs_points_at_once_then_skips_finished_ones(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--models", "transformer,mamba2", "--widths", "16", "--lrs", "1e-3",
            "--jobs", "2", "--", *TINY]
    assert mqar_sweep.main(argv) == 0
    out = capsys.readouterr().out
    for model in ("transformer", "mamba2"):
        summary = json.loads((tmp_path / f"{model}-d16-lr0.001-s0" / "summary.json").read_text())
        assert summary["step"] == 3 and summary["best_mqar_acc"] is not None
        assert f"| {model} |" in out
    result = json.loads((tmp_path / "sweep_result.json").read_text())
    assert result["launched"] == 2 and result["steps"] == 6 and result["steps_per_s"] > 0 and not result["failed"]
    assert (tmp_path / "mqar_table.md").is_file()
    assert mqar_sweep.main(argv) == 0  # every point has its summary: nothing is run again
    assert json.loads((tmp_path / "sweep_result.json").read_text())["launched"] == 0


def test_a_failing_point_is_reported_and_unknown_models_refused(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--models", "mamba2", "--widths", "16", "--lrs", "1e-3", "--",
            *TINY, "trainer.batch_size=0"]
    assert mqar_sweep.main(argv) == 1
    assert "point failed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mqar_sweep.main(["--out", str(tmp_path), "--models", "no_such_model"])
    assert "unknown MQAR model" in capsys.readouterr().err
