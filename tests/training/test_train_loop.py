"""The training loop end to end on CPU: loss falls, resume is exact, nothing is overwritten or lost."""
import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.training.helpers import metrics, nan_training_losses, run_train, small_cfg


def _weights(ckpt):
    return load_file(str(ckpt / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run") / "full"
    summary = run_train(small_cfg(), run_dir)
    return run_dir, summary


def test_run_writes_checkpoints_metrics_and_curve(six_steps):
    run_dir, summary = six_steps
    assert summary["step"] == 6 and summary["skipped_steps"] == 0
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert ckpts == ["step_00000003", "step_00000006"]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000006"
    assert (run_dir / "loss_curve.png").stat().st_size > 0
    rows = metrics(run_dir)
    steps = [r["step"] for r in rows if "train/loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    for r in rows:
        if "train/loss" in r:
            assert r["perf/tokens_per_s"] > 0 and r["perf/data_wait_s"] >= 0 and r["train/grad_norm"] > 0
    vals = [r["val/loss"] for r in rows if "val/loss" in r]
    assert len(vals) == 3 and all(not math.isnan(v) for v in vals)  # step 0, step 3, final


def test_resume_is_bit_exact(six_steps, tmp_path):
    full_dir, _ = six_steps
    # a run that stopped after its step-3 checkpoint: same config, only that checkpoint on disk
    part_dir = tmp_path / "part"
    shutil.copytree(full_dir / "checkpoints" / "step_00000003", part_dir / "checkpoints" / "step_00000003")
    (part_dir / "checkpoints" / "latest").write_text("step_00000003")
    summary = run_train(small_cfg(), part_dir)
    assert summary["step"] == 6
    a = _weights(full_dir / "checkpoints" / "step_00000006")
    b = _weights(part_dir / "checkpoints" / "step_00000006")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    loss = lambda rows: [r["train/loss"] for r in rows if "train/loss" in r and r["step"] > 3]
    assert loss(metrics(part_dir)) == loss(metrics(full_dir))
    state = json.loads((part_dir / "checkpoints" / "step_00000006" / "trainer_state.json").read_text())
    assert state["tokens"] == 6 * 4 * 64


def test_checkpoint_with_weights_in_accelerate_state_resumes_from_them(six_steps, tmp_path):
    """A checkpoint of the earlier layout (the weights also in accelerate/model.safetensors) resumes bit for bit from
    accelerate's copy; model/'s copy is spoiled here, so a resume that read it would differ."""
    from safetensors.torch import save_file

    from training.checkpoint import write_manifest

    full_dir, _ = six_steps
    step = tmp_path / "old" / "checkpoints" / "step_00000003"
    shutil.copytree(full_dir / "checkpoints" / "step_00000003", step)
    (step.parent / "latest").write_text(step.name)
    weights = _weights(step)
    save_file(weights, str(step / "accelerate" / "model.safetensors"))
    save_file({k: v + 1 for k, v in weights.items()}, str(step / "model" / "model.safetensors"))
    write_manifest(step)
    assert run_train(small_cfg(), tmp_path / "old")["step"] == 6
    a, b = _weights(full_dir / "checkpoints" / "step_00000006"), _weights(step.parent / "step_00000006")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fresh_run_refuses_to_overwrite_checkpoints(six_steps):
    run_dir, _ = six_steps
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    with pytest.raises(FileExistsError, match="trainer.resume=auto"):
        run_train(small_cfg("trainer.resume=none"), run_dir)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before


def test_missing_resume_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run_train(small_cfg(f"trainer.resume={tmp_path / 'nope'}"), tmp_path / "run")


@pytest.mark.parametrize("fused", [False, True])  # fused AdamW skips on the device (found_inf), no host sync
def test_non_finite_step_is_skipped_and_counted(tmp_path, monkeypatch, fused):
    nan_training_losses(monkeypatch, {2})  # the second training step's loss is NaN
    summary = run_train(small_cfg("trainer.max_steps=4", "trainer.save_every=0", f"optim.fused={fused}"),
                        tmp_path / "run")
    assert summary["skipped_steps"] == 1 and summary["step"] == 4
    weights = _weights(tmp_path / "run" / "checkpoints" / "step_00000004")
    assert all(torch.isfinite(w).all() for w in weights.values())
    logged = [r for r in metrics(tmp_path / "run") if "train/skipped_steps" in r]
    assert logged[-1]["train/skipped_steps"] == 1
    # the NaN step's loss is left out of every window's mean (a window of only that step logs NaN: no updates)
    assert sum(r["train/loss"] != r["train/loss"] for r in logged) <= 1


def test_loss_falls_and_varlen_packing_trains(tmp_path):
    summary = run_train(small_cfg("trainer.max_steps=40", "trainer.save_every=0", "trainer.val_every=0",
                                  "data.packing=varlen", "optim.warmup_steps=5"), tmp_path / "run")
    rows = metrics(tmp_path / "run")
    vals = [r["val/loss"] for r in rows if "val/loss" in r]
    assert vals[-1] < vals[0] - 1.0, vals
    assert summary["val_loss"] == vals[-1]


def test_gradient_checkpointing_changes_memory_not_results(tmp_path):
    plain = run_train(small_cfg("trainer.max_steps=3", "trainer.save_every=0"), tmp_path / "plain")
    ckpt = run_train(small_cfg("trainer.max_steps=3", "trainer.save_every=0", "trainer.gradient_checkpointing=true"),
                     tmp_path / "ckpt")
    assert plain["val_loss"] == ckpt["val_loss"]
    a = _weights(tmp_path / "plain" / "checkpoints" / "step_00000003")
    b = _weights(tmp_path / "ckpt" / "checkpoints" / "step_00000003")
    assert all(torch.equal(a[k], b[k]) for k in a)
