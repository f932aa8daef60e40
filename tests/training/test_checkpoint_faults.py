"""Fault injection on checkpoints: crafted pickles are refused without running, a damaged newest checkpoint falls
back to the previous one with a warning naming the file, a run directory of unreadable checkpoints stops instead
of starting over, and a save that fails (a full disk) leaves the earlier checkpoints intact (docs/robustness.md)."""
from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.training.helpers import REPO, run_train, small_cfg
from training.checkpoint import (
    MANIFEST,
    CheckpointError,
    CheckpointManager,
    CheckpointWriteError,
    UnsafeCheckpointError,
    check_dcp_metadata,
    load_data,
    select_resume_checkpoint,
    verify_checkpoint,
    write_manifest,
)

FOUR = ("trainer.max_steps=4", "trainer.save_every=2", "trainer.val_every=0", "trainer.final_eval=false")
DAMAGEABLE = ["model/model.safetensors", "accelerate/optimizer.bin", "trainer_state.json", "scheduler.pt",
              "loader/rank00000.pt"]


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """A run with checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("four") / "run"
    run_train(small_cfg(*FOUR), run_dir)
    return run_dir


@pytest.fixture()
def run_copy(four_steps, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(four_steps, dst)
    return dst


class _Marker:
    """Unpickling this runs os.system: what a hostile checkpoint does."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _damage(f: Path, how: str) -> None:
    if how == "deleted":
        f.unlink()
    elif how == "truncated":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    else:  # garbage of the same size: only the checksum (or a failed read) can tell
        f.write_bytes(bytes((i * 37 + 11) % 256 for i in range(f.stat().st_size)))


def _mgr(run_dir: Path) -> CheckpointManager:
    return CheckpointManager(run_dir / "checkpoints", keep_last=2, accelerator=None)


def test_checkpoints_have_a_manifest_of_every_file(four_steps):
    ckpts = four_steps / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000004"
    assert not list(ckpts.glob("*.tmp"))
    for step in ("step_00000002", "step_00000004"):
        manifest = json.loads((ckpts / step / MANIFEST).read_text())
        on_disk = {p.relative_to(ckpts / step).as_posix() for p in (ckpts / step).rglob("*")
                   if p.is_file() and p.name != MANIFEST}
        assert set(manifest["files"]) == on_disk
        assert set(DAMAGEABLE) <= on_disk
        for rel, entry in manifest["files"].items():
            assert (ckpts / step / rel).stat().st_size == entry["size"]
        assert verify_checkpoint(ckpts / step) == []


@pytest.mark.parametrize("with_manifest", [True, False], ids=["manifest", "no-manifest"])
@pytest.mark.parametrize("how", ["truncated", "deleted", "garbage"])
@pytest.mark.parametrize("rel", DAMAGEABLE)
def test_damaged_newest_falls_back_to_previous(run_copy, rel, how, with_manifest):
    ckpts = run_copy / "checkpoints"
    if not with_manifest:  # a checkpoint written before manifests: verified by reading its files
        for step in ckpts.glob("step_*"):
            (step / MANIFEST).unlink(missing_ok=True)
    _damage(ckpts / "step_00000004" / rel, how)
    with pytest.warns(UserWarning, match=rf"skipping checkpoint .*step_00000004.*{rel.split('/')[-1]}"):
        chosen = _mgr(run_copy).resolve_resume("auto")
    assert chosen == ckpts / "step_00000002"


def test_every_checkpoint_damaged_stops_with_the_way_out(run_copy):
    ckpts = run_copy / "checkpoints"
    _damage(ckpts / "step_00000004" / "scheduler.pt", "truncated")
    _damage(ckpts / "step_00000002" / "accelerate" / "optimizer.bin", "garbage")
    with pytest.warns(UserWarning), pytest.raises(CheckpointError) as info:
        _mgr(run_copy).resolve_resume("auto")
    msg = str(info.value)
    assert "scheduler.pt" in msg and "optimizer.bin" in msg
    assert "trainer.resume=" in msg and "trainer.resume=none name=<new name>" in msg


def test_state_file_missing_everywhere_is_an_error_not_a_fresh_start(run_copy):
    ckpts = run_copy / "checkpoints"
    for step in ckpts.glob("step_*"):
        (step / "trainer_state.json").unlink()
        (step / MANIFEST).unlink(missing_ok=True)
    with pytest.warns(UserWarning, match="trainer_state.json"), pytest.raises(CheckpointError, match="none can be"):
        _mgr(run_copy).resolve_resume("auto")
    with pytest.raises(FileExistsError, match="already holds checkpoints"):
        _mgr(run_copy).resolve_resume("none")
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="none can be resumed"):
        run_train(small_cfg(*FOUR, "trainer.max_steps=6"), run_copy)
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000002", "step_00000004"]


def test_explicit_damaged_checkpoint_is_refused_naming_the_file(run_copy):
    step = run_copy / "checkpoints" / "step_00000004"
    _damage(step / "loader" / "rank00000.pt", "garbage")
    with pytest.raises(CheckpointError, match=r"rank00000\.pt"):
        _mgr(run_copy).resolve_resume(str(step))


def test_damaged_rng_file_resumes_with_a_not_exact_warning(run_copy):
    ckpts = run_copy / "checkpoints"
    _damage(ckpts / "step_00000004" / "accelerate" / "random_states_0.pkl", "truncated")
    with pytest.warns(UserWarning, match="not be bit-exact"):
        assert _mgr(run_copy).resolve_resume("auto") == ckpts / "step_00000004"


def test_resume_after_damage_trains_on_from_the_previous_checkpoint(run_copy):
    ckpts = run_copy / "checkpoints"
    _damage(ckpts / "step_00000004" / "model" / "model.safetensors", "truncated")
    with pytest.warns(UserWarning, match="model.safetensors"):
        summary = run_train(small_cfg(*FOUR, "trainer.max_steps=6"), run_copy)
    assert summary["step"] == 6
    assert verify_checkpoint(ckpts / "step_00000004") == []  # rewritten whole by the resumed run


# -- crafted pickles ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rel", ["scheduler.pt", "loader/rank00000.pt", "accelerate/optimizer.bin",
                                 "accelerate/random_states_0.pkl"])
def test_crafted_pickle_is_refused_and_never_runs(run_copy, tmp_path, rel):
    marker = tmp_path / "ran"
    step = run_copy / "checkpoints" / "step_00000004"
    torch.save({"state": _Marker(marker)}, step / rel)
    with pytest.raises((UnsafeCheckpointError, CheckpointError)):
        load_data(step / rel)
    (step / MANIFEST).unlink(missing_ok=True)  # without a manifest, verification reads the file
    if rel.endswith("random_states_0.pkl"):  # accelerate reads it as data; only exactness is lost
        with pytest.warns(UserWarning, match="not be bit-exact"):
            assert _mgr(run_copy).resolve_resume("auto") == step
    else:  # and skips the checkpoint
        with pytest.warns(UserWarning, match=rf"skipping .*{rel.split('/')[-1]}.*refused"):
            assert _mgr(run_copy).resolve_resume("auto") == run_copy / "checkpoints" / "step_00000002"
    assert not marker.exists()


def test_crafted_rng_file_with_matching_manifest_resumes_not_exact(run_copy, tmp_path):
    marker = tmp_path / "ran"
    step = run_copy / "checkpoints" / "step_00000004"
    torch.save({"state": _Marker(marker)}, step / "accelerate" / "random_states_0.pkl")
    write_manifest(step)  # the attacker rewrote the manifest too: the load itself must refuse
    with pytest.warns(UserWarning, match="random_states_0.pkl.*not be bit-exact"):
        assert run_train(small_cfg(*FOUR, "trainer.max_steps=5"), run_copy)["step"] == 5
    assert not marker.exists()


@pytest.mark.parametrize("rel", ["scheduler.pt", "loader/rank00000.pt", "accelerate/optimizer.bin"])
def test_crafted_pickle_with_matching_manifest_is_refused_on_resume(run_copy, tmp_path, rel):
    marker = tmp_path / "ran"
    step = run_copy / "checkpoints" / "step_00000004"
    torch.save({"state": _Marker(marker)}, step / rel)
    write_manifest(step)
    with pytest.raises(UnsafeCheckpointError, match=rf"{rel.split('/')[-1]}: refused.*posix.system"):
        run_train(small_cfg(*FOUR, "trainer.max_steps=6"), run_copy)
    assert not marker.exists()


def test_crafted_optimizer_state_is_refused_across_layouts(run_copy, tmp_path):
    from training.checkpoint import _full_optimizer_state

    marker = tmp_path / "ran"
    acc_dir = run_copy / "checkpoints" / "step_00000004" / "accelerate"
    torch.save({"state": {}, "param_groups": _Marker(marker)}, acc_dir / "optimizer.bin")
    with pytest.raises(UnsafeCheckpointError, match="optimizer.bin"):
        _full_optimizer_state(acc_dir, "plain", torch.nn.Linear(2, 2), None)
    assert not marker.exists()


def test_dcp_metadata_is_checked_before_dcp_unpickles_it(tmp_path):
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(4, 3)
    dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ok")), no_dist=True)
    check_dcp_metadata(tmp_path / "ok" / ".metadata")  # genuine metadata passes
    marker = tmp_path / "ran"
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / ".metadata").write_bytes(pickle.dumps(_Marker(marker)))
    with pytest.raises(UnsafeCheckpointError, match="posix.system|os.system"):
        check_dcp_metadata(tmp_path / "bad" / ".metadata")
    assert not marker.exists()


# -- write errors -------------------------------------------------------------------------------------------------
def test_disk_full_during_save_keeps_earlier_checkpoints(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if "step_00000004.tmp" in str(f) and str(f).endswith("scheduler.pt"):
            real_save(obj, f, *args, **kwargs)  # a partly written file, as a full disk leaves
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(CheckpointWriteError, match=r"disk full.*step_00000004\.tmp/scheduler\.pt"):
        run_train(small_cfg(*FOUR), run_dir)
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002"]
    assert (ckpts / "latest").read_text() == "step_00000002"
    assert verify_checkpoint(ckpts / "step_00000002") == []
    monkeypatch.setattr(torch, "save", real_save)
    assert select_resume_checkpoint(ckpts) == ckpts / "step_00000002"


_FSIZE_SCRIPT = """
import resource, signal, sys
sys.path.insert(0, {repo!r})
from tests.training.helpers import run_train, small_cfg
from training.checkpoint import CheckpointManager
real, calls = CheckpointManager.save, []
def save(self, *a, **k):
    calls.append(1)
    if len(calls) == 2:  # the second save: every file write beyond 1 MiB fails (EFBIG), as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    return real(self, *a, **k)
CheckpointManager.save = save
run_train(small_cfg(*{four!r}), {run_dir!r})
"""


def test_file_size_limit_during_save_is_reported_as_disk_full(tmp_path):
    run_dir = tmp_path / "run"
    script = _FSIZE_SCRIPT.format(repo=str(REPO), four=FOUR, run_dir=str(run_dir))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=600, check=False)
    assert proc.returncode != 0
    assert "CheckpointWriteError" in proc.stderr and "disk full" in proc.stderr and "step_00000004" in proc.stderr
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert select_resume_checkpoint(ckpts) == ckpts / "step_00000002"
