"""The run directory is anchored at paths.runs (conf/paths/default.yaml), not at the working directory: a run launched
from one directory is found and resumed from another, paths.runs and HILO_RUNS move it, relative values are taken
against the launch directory once, and eval.py finds a run by its name under paths.runs."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.training.helpers import CONF, REPO, SMALL
from training.checkpoint import write_manifest
from training.config import ConfigError, anchor_paths, locate_checkpoint, runs_dir

ENV = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
ENV.pop("HILO_RUNS", None)
NAME = "transformer-tiny-pydocs-T64"  # the default name of the SMALL config
QUICK = [*SMALL, "trainer.val_every=0", "trainer.val_batches=1"]


def _compose(*overrides, config_name="train"):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)


@pytest.fixture(autouse=True)
def _elsewhere(tmp_path, monkeypatch):
    """Every test runs from a directory that is not the checkout, without HILO_RUNS."""
    monkeypatch.delenv("HILO_RUNS", raising=False)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")


def test_run_and_sweep_dirs_are_under_the_checkout_whatever_the_working_directory():
    cfg = _compose(*SMALL)
    assert cfg.paths.runs == str(REPO / "runs") and Path(cfg.paths.root) == REPO
    assert cfg.hydra.run.dir == str(REPO / "runs" / NAME)
    assert cfg.hydra.sweep.dir == str(REPO / "runs" / "sweeps" / NAME)
    assert _compose("checkpoint=x", config_name="eval").hydra.run.dir == str(REPO / "runs" / ".eval_hydra")
    assert runs_dir(OmegaConf.create({"name": "x"})) == REPO / "runs"  # a config without paths (built by hand)


def test_paths_runs_and_hilo_runs_move_every_directory(tmp_path, monkeypatch):
    cfg = _compose(*SMALL, f"paths.runs={tmp_path / 'scratch'}")
    assert cfg.hydra.run.dir == str(tmp_path / "scratch" / NAME) and runs_dir(cfg) == tmp_path / "scratch"
    sweep = _compose("experiment=mqar_sweep", "+model/mqar=mamba2", f"paths.runs={tmp_path / 'scratch'}")
    assert sweep.hydra.run.dir.startswith(str(tmp_path / "scratch" / "mqar") + "/")
    assert sweep.hydra.sweep.dir == str(tmp_path / "scratch" / "sweeps" / "mqar_sweep")
    monkeypatch.setenv("HILO_RUNS", str(tmp_path / "env"))
    assert _compose(*SMALL).hydra.run.dir == str(tmp_path / "env" / NAME)
    assert _compose(*SMALL, f"paths.runs={tmp_path / 'cli'}").paths.runs == str(tmp_path / "cli")  # the CLI wins


def test_a_relative_paths_runs_is_taken_against_the_launch_directory(tmp_path):
    cfg = _compose(*SMALL, "paths.runs=rel/runs")
    anchor_paths(cfg)
    assert cfg.paths.runs == str(tmp_path / "cwd" / "rel" / "runs")
    for bad, needle in (("'~/runs'", r"\$HOME/runs"), ("''", "paths.runs is empty")):
        with pytest.raises(ConfigError, match=needle):
            anchor_paths(_compose(*SMALL, f"paths.runs={bad}"))


def test_eval_checkpoint_is_a_path_or_a_run_name_under_paths_runs(tmp_path):
    runs = tmp_path / "runs"
    (runs / "a").mkdir(parents=True)
    assert locate_checkpoint("a", runs) == runs / "a"
    (tmp_path / "cwd" / "a").mkdir()
    assert locate_checkpoint("a", runs) == Path("a")  # a path that exists from the working directory comes first
    assert locate_checkpoint(str(runs / "a"), tmp_path / "other") == runs / "a"
    with pytest.raises(FileNotFoundError, match=rf"does not exist: neither .*cwd/b nor {runs / 'b'}"):
        locate_checkpoint("b", runs)


def _train(cwd, *args, env=None):
    return subprocess.run([sys.executable, str(REPO / "train.py"), *QUICK, *args], cwd=cwd, capture_output=True,
                          text=True, check=False, timeout=300, env=env or ENV)


@pytest.mark.slow
def test_a_run_launched_from_one_directory_resumes_from_others(tmp_path):
    runs = tmp_path / "runs"
    launch, other, third = (tmp_path / d for d in ("launch", "other", "third"))
    for d in (launch, other, third):
        d.mkdir()
    res = _train(launch, "trainer.max_steps=2", env={**ENV, "HILO_RUNS": str(runs)})
    assert res.returncode == 0, res.stderr[-3000:]
    assert list(launch.iterdir()) == []  # nothing lands in the working directory
    step = runs / NAME / "checkpoints" / "step_00000002"
    assert step.is_dir()
    assert OmegaConf.load(runs / NAME / "config.yaml").paths.runs == str(runs)

    # a checkpoint of an older hilo: its config lacks a setting added since (its manifest rewritten to match)
    saved = OmegaConf.load(step / "config.yaml")
    del saved.data["max_document_chars"]
    OmegaConf.save(saved, step / "config.yaml")
    write_manifest(step)

    # a relative paths.runs from another directory reaches the same run; the lacking setting at another value blocks
    res = _train(other, "trainer.max_steps=3", "paths.runs=../runs", "data.max_document_chars=1000")
    assert res.returncode != 0
    assert ("data.max_document_chars: (not set) -> 1000 (absent from the checkpoint's config; its default is "
            "10000000)") in res.stderr
    assert not (runs / NAME / "checkpoints" / "step_00000003").exists()

    # at its default it is no difference: the run resumes from a third directory
    res = _train(third, "trainer.max_steps=3", f"paths.runs={runs}")
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout + res.stderr
    assert "resume: data.max_document_chars: absent from the checkpoint's config, taken at its default 10000000" in out
    assert f"resumed from {step} at step 2" in out
    assert (runs / NAME / "checkpoints" / "step_00000003").is_dir()
    assert list(other.iterdir()) == [] and list(third.iterdir()) == []


def test_eval_finds_a_run_by_name_under_paths_runs(tmp_path, monkeypatch):
    import eval as eval_entry
    import training.evaluation

    ckpt = tmp_path / "runs" / "r" / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    seen = {}

    def evaluate(path, *args, **kwargs):
        seen["ckpt"] = path
        raise RuntimeError("stop after locating the checkpoint")

    monkeypatch.setattr(training.evaluation, "evaluate_checkpoint", evaluate)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="eval", overrides=["checkpoint=r", f"paths.runs={tmp_path / 'runs'}", "logger=none"])
    with pytest.raises(RuntimeError, match="stop after locating"):
        eval_entry.run(cfg)
    assert seen["ckpt"] == ckpt
