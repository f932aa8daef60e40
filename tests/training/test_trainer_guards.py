"""The trainer's start-up guards end to end on CPU: a live run directory is refused, a resume whose settings change
what the run computes stops with their list, and an accepted new learning rate takes effect."""
import pytest

from tests.training.helpers import metrics, run_train, small_cfg
from training.resume_check import ResumeConfigError
from training.run_lock import RunLock, RunLockedError


def test_a_run_directory_held_by_another_run_is_refused(tmp_path):
    holder = RunLock(tmp_path / "run").acquire()  # another open file description: flock refuses it as another process
    try:
        with pytest.raises(RunLockedError, match="in use by another process"):
            run_train(small_cfg("trainer.max_steps=1"), tmp_path / "run")
    finally:
        holder.release()
    assert run_train(small_cfg("trainer.max_steps=1", "trainer.save_every=0"), tmp_path / "run")["step"] == 1


def test_resume_with_another_lr_stops_unless_accepted_then_uses_it(tmp_path):
    run_dir = tmp_path / "run"
    run_train(small_cfg("trainer.max_steps=3", "optim.schedule=constant"), run_dir)
    with pytest.raises(ResumeConfigError, match=r"optim\.lr: 0\.003 -> 0\.001"):
        run_train(small_cfg("trainer.max_steps=5", "optim.schedule=constant", "optim.lr=1e-3"), run_dir)
    run_train(small_cfg("trainer.max_steps=5", "optim.schedule=constant", "optim.lr=1e-3",
                        "trainer.resume_override=[optim.lr]"), run_dir)
    lrs = {r["step"]: r["train/lr"] for r in metrics(run_dir) if "train/lr" in r}
    assert lrs[3] == pytest.approx(3e-3) and lrs[4] == pytest.approx(1e-3) and lrs[5] == pytest.approx(1e-3)
