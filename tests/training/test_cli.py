"""The command lines a user types: train.py and eval.py as subprocesses, SIGTERM, W&B offline, bad input."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.training.helpers import REPO, SMALL

ENV = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="", WANDB_SILENT="true")
ENV.pop("WANDB_MODE")


def _train(args, timeout=300, env=None, flags=()):
    return subprocess.run([sys.executable, "train.py", *flags, *SMALL, *args], cwd=REPO, capture_output=True,
                          text=True, check=False, timeout=timeout, env=env or ENV)


def test_sigterm_saves_then_exits_and_the_run_resumes(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "train.py", *SMALL, "trainer.max_steps=100000", "trainer.save_every=0",
                             "trainer.val_every=0", f"hydra.run.dir={run_dir}"],
                            cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and sum("train/loss" in line for line in metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.stdout.read()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "stop requested" in out
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    assert len(ckpts) == 1
    stopped_at = int(ckpts[0].name.split("_")[1])
    assert stopped_at >= 3
    # continue it to a fixed end: resume=auto picks the SIGTERM checkpoint
    res = _train([f"trainer.max_steps={stopped_at + 2}", "trainer.save_every=0", "trainer.val_every=0",
                  f"hydra.run.dir={run_dir}"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {ckpts[0]}" in res.stdout + res.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == stopped_at + 2


def test_wandb_offline_run_directory_has_config_and_metrics(tmp_path):
    run_dir = tmp_path / "run"
    res = _train(["trainer.max_steps=3", "logger=wandb", "logger.mode=offline", f"hydra.run.dir={run_dir}"])
    assert res.returncode == 0, res.stderr[-3000:]
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # offline runs keep config, history and summary in the run's .wandb log (what `wandb sync` uploads)
    log = next(runs[0].glob("run-*.wandb")).read_bytes()
    assert b'"seq_len":64' in log and b"transformer-tiny-pydocs-T64" in log
    for key in (b"train/loss", b"val/loss", b"perf/tokens_per_s"):
        assert key in log, key


@pytest.mark.parametrize("args, needle", [
    (["model=no_such_model"], "no_such_model"),
    (["trainer.max_steps=abc"], "trainer.max_steps"),
    (["data.sources.0.paths=[/no/such/file.jsonl]"], "/no/such/file.jsonl"),
    (["model.hidden_sizee=4"], "hidden_sizee"),
])
def test_bad_input_fails_fast_with_a_clear_message(tmp_path, args, needle):
    res = _train([*args, f"hydra.run.dir={tmp_path / 'run'}"], timeout=120)
    assert res.returncode != 0
    assert needle in res.stderr + res.stdout
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_eval_writes_json_and_png_and_rejects_a_missing_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    res = _train(["trainer.max_steps=2", "trainer.final_eval=true", "eval.seq_len=96", "eval.num_documents=2",
                  f"hydra.run.dir={run_dir}"])
    assert res.returncode == 0, res.stderr[-3000:]
    final = json.loads((run_dir / "summary.json").read_text())["eval"]  # the training run's own final evaluation
    assert final["ppl"] > 1 and Path(final["json"]).parent.name == "ppl_by_position_T96"
    ev = subprocess.run([sys.executable, "eval.py", f"checkpoint={run_dir}", "eval=ppl_by_position",
                         "eval.seq_len=128", "eval.num_documents=2", "logger=none"],
                        cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV, check=False)
    assert ev.returncode == 0, ev.stderr[-3000:]
    out = run_dir / "eval" / "ppl_by_position_T128"
    report = json.loads(next(out.glob("*.json")).read_text())
    assert report["num_documents"] == 2 and len(report["per_position_nll"]) == 128
    assert next(out.glob("*.png")).stat().st_size > 0
    bad = subprocess.run([sys.executable, "eval.py", f"checkpoint={tmp_path / 'missing'}"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env=ENV, check=False)
    assert bad.returncode != 0 and "does not exist" in bad.stderr


def test_multirun_sweep_runs_one_job_per_point(tmp_path):
    sweep = tmp_path / "sweep"
    res = _train(["optim.lr=1e-3,3e-3", "trainer.max_steps=2", "trainer.save_every=0", "trainer.val_every=0",
                  f"hydra.sweep.dir={sweep}"], flags=["-m"])
    assert res.returncode == 0, res.stderr[-3000:]
    jobs = sorted(p.name for p in sweep.iterdir() if (p / "summary.json").exists())
    assert jobs == ["0", "1"]
    for job, lr in zip(jobs, ("0.001", "0.003")):
        assert f"lr: {lr}" in (sweep / job / "config.yaml").read_text()
