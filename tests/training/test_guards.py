"""training.guards.NonFiniteGuard: stops after N consecutive non-finite steps, not after N scattered ones."""
import pytest
import torch

from training.guards import NonFiniteGuard, NonFiniteLossError


def feed(guard, pattern, start=1):
    for i, finite in enumerate(pattern):
        guard.update(torch.tensor(finite), start + i)


def test_n_consecutive_non_finite_steps_raise_naming_steps_and_fix():
    guard = NonFiniteGuard(3)
    feed(guard, [True, False, False, False, True])
    with pytest.raises(NonFiniteLossError, match=r"3 consecutive non-finite steps.*steps 2-4.*"
                                                 r"last good checkpoint is kept: runs/x/step_1.*optim\.lr"):
        guard.check("runs/x/step_1")


def test_scattered_or_shorter_streaks_do_not_raise():
    guard = NonFiniteGuard(3)
    for _ in range(10):
        feed(guard, [False, False, True])
        guard.check()
    feed(guard, [False, False])
    guard.check()


def test_a_streak_across_two_checks_counts_whole():
    guard = NonFiniteGuard(4)
    feed(guard, [True, False, False])
    guard.check()
    feed(guard, [False, False], start=4)
    with pytest.raises(NonFiniteLossError, match=r"4 consecutive.*steps 2-5.*no checkpoint was saved"):
        guard.check()


def test_every_step_non_finite_stops_at_the_first_check():
    guard = NonFiniteGuard(20)
    feed(guard, [False] * 30)
    with pytest.raises(NonFiniteLossError, match="30 consecutive"):
        guard.check()


def test_disabled_and_bad_settings():
    guard = NonFiniteGuard(None)
    feed(guard, [False] * 50)
    guard.check()
    for bad in (0, -1, 2.5, True, "20"):
        with pytest.raises(ValueError, match="trainer.max_nonfinite_steps"):
            NonFiniteGuard(bad)


def test_python_bools_are_accepted():
    guard = NonFiniteGuard(2)
    guard.update(False, 1)
    guard.update(False, 2)
    with pytest.raises(NonFiniteLossError):
        guard.check()


def test_training_stops_after_consecutive_non_finite_steps_keeping_the_last_good_checkpoint(tmp_path, monkeypatch):
    """The loop wires the guard in: from step 3 on every loss is NaN; with trainer.max_nonfinite_steps=4 the run
    raises at the step-6 log window instead of running to max_steps; the step-6 checkpoint is never written, the
    earlier ones stay and the message names the newest."""
    from tests.training.helpers import nan_training_losses, run_train, small_cfg
    from training.guards import NonFiniteLossError

    nan_training_losses(monkeypatch, range(3, 1000))
    run_dir = tmp_path / "run"
    cfg = small_cfg("trainer.max_steps=12", "trainer.save_every=2", "trainer.log_every=1",
                    "trainer.max_nonfinite_steps=4")
    with pytest.raises(NonFiniteLossError, match=r"4 consecutive non-finite steps.*steps 3-6.*step_00000004"):
        run_train(cfg, run_dir)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000004"]
