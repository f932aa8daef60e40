"""benchmarks/mqar_sweep.py on CPU: two tiny points at once, their table and throughput, and a re-run that skips them."""
import json
import sys
from pathlib import Path

import pytest

from benchmarks import mqar_sweep

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


def test_a_point_stopped_by_a_signal_is_resumed_not_skipped(tmp_path):
    argv = ["--out", str(tmp_path), "--models", "transformer", "--widths", "16", "--lrs", "1e-3", "--", *TINY]
    assert mqar_sweep.main(argv) == 0
    summary_path = tmp_path / "transformer-d16-lr0.001-s0" / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary_path.write_text(json.dumps({**summary, "stopped_by_signal": True}))  # as a SIGTERM'd run leaves it
    assert mqar_sweep.main([*argv, "trainer.max_steps=5"]) == 0
    result = json.loads((tmp_path / "sweep_result.json").read_text())
    assert result["launched"] == 1 and result["steps"] == 2  # resumed at step 3, ran steps 4 and 5
    resumed = json.loads(summary_path.read_text())
    assert resumed["step"] == 5 and not resumed["stopped_by_signal"]


def test_a_point_with_an_unreadable_summary_is_run_again(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / mqar_sweep.point_name("mamba2", 16, 1e-3, 0)
    run_dir.mkdir()
    (run_dir / "summary.json").write_text("")  # its run was killed while writing it
    launched = []
    monkeypatch.setattr(mqar_sweep, "_loop", lambda todo, *args: launched.extend(todo) or len(todo))
    mqar_sweep.run_grid([("mamba2", 16, 1e-3, 0)], tmp_path, 1, None, [])
    assert [d for d, _ in launched] == [run_dir]
    assert str(run_dir / "summary.json") in capsys.readouterr().err


def test_sigterm_stops_the_grid_and_its_points_save(tmp_path):
    """SIGTERM to the sweep: no point is left running, each running point saves and records stopped_by_signal,
    and the sweep exits 130."""
    import signal
    import subprocess
    import time

    out = tmp_path / "grid"
    cmd = [sys.executable, str(Path(mqar_sweep.__file__)), "--out", str(out), "--models", "transformer,mamba2",
           "--widths", "16", "--lrs", "1e-3", "--jobs", "1", "--", *TINY, "trainer.max_steps=100000",
           "trainer.val_every=0", "trainer.log_every=1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "transformer-d16-lr0.001-s0" / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2) and time.time() < deadline:
        time.sleep(0.5)
    assert metrics.is_file(), "the first point never started training"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, err
    summary = json.loads((out / "transformer-d16-lr0.001-s0" / "summary.json").read_text())
    assert summary["stopped_by_signal"] and summary["step"] < 100000
    assert not (out / "mamba2-d16-lr0.001-s0").exists()  # the second point was never started
    assert "continues the grid" in err


def test_each_point_gets_an_equal_share_of_the_cores(tmp_path, monkeypatch):
    """torch's default of one thread per core in every point oversubscribes the machine: each point is launched with
    OMP_NUM_THREADS = cores // jobs (at least 1), unless the caller chose a value."""
    assert mqar_sweep.point_env(8, environ={}, cores=16)["OMP_NUM_THREADS"] == "2"
    assert mqar_sweep.point_env(20, environ={}, cores=16)["OMP_NUM_THREADS"] == "1"
    assert mqar_sweep.point_env(8, environ={"OMP_NUM_THREADS": "6"}, cores=16)["OMP_NUM_THREADS"] == "6"
    launched_envs = []

    class FinishedAtOnce:
        returncode = 0

        def __init__(self, cmd, env, **kwargs):
            launched_envs.append(env)

        def poll(self):
            return 0

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(mqar_sweep.subprocess, "Popen", FinishedAtOnce)
    monkeypatch.setattr(mqar_sweep.os, "sched_getaffinity", lambda pid: set(range(4)))
    points = [("mamba2", 16, 1e-3, seed, mqar_sweep.NO_VARIANT) for seed in (0, 1)]
    mqar_sweep.run_grid(points, tmp_path, jobs=2, gpus=None, extra=[])
    assert [env["OMP_NUM_THREADS"] for env in launched_envs] == ["2", "2"]


def test_variants_run_as_points_of_their_own_with_their_overrides_last(tmp_path, capsys):
    """--variant NAME [OVERRIDE...]: every point runs once per variant, in <point>-<name>/, with the variant's
    overrides after the grid's (they win; none: the grid's recipe, a named baseline), and the table has a row per
    (model, variant)."""
    argv = ["--out", str(tmp_path), "--models", "transformer", "--widths", "16", "--lrs", "1e-3", "--jobs", "2",
            "--variant", "short", "trainer.max_steps=2", "--variant", "noclip", "optim.grad_clip=0", "--variant", "base",
            "--", *TINY]
    assert mqar_sweep.main(argv) == 0
    out = capsys.readouterr().out
    short, noclip = (tmp_path / f"transformer-d16-lr0.001-s0-{v}" for v in ("short", "noclip"))
    assert json.loads((short / "summary.json").read_text())["step"] == 2  # the variant's max_steps beat the grid's 3
    assert json.loads((noclip / "summary.json").read_text())["step"] == 3
    assert (noclip / "variant.txt").read_text().split("\n")[:2] == ["noclip", "optim.grad_clip=0"]
    assert json.loads((tmp_path / "transformer-d16-lr0.001-s0-base" / "summary.json").read_text())["step"] == 3
    assert all(f"| transformer ({v}) |" in out for v in ("short", "noclip", "base"))
    assert not (tmp_path / "transformer-d16-lr0.001-s0").exists()
    for bad, message in ((["--variant", "a.b", "x=1"], "letters, digits"),
                         (["--variant", "v", "x=1", "--variant", "v", "y=2"], "given twice"),
                         (["--variant", "x=1"], "first word")):
        with pytest.raises(SystemExit):
            mqar_sweep.main(["--out", str(tmp_path), "--models", "transformer", *bad])
        assert message in capsys.readouterr().err
