"""A run stopped by SIGTERM that gets a second one (a sweep or `timeout` passing the stop on) still ends whole."""
import json
import os
import signal

from tests.training.helpers import run_train, small_cfg


def test_a_second_sigterm_while_the_stopped_run_ends_is_absorbed(tmp_path, monkeypatch):
    from training.logging import MetricsLogger
    from training.trainer import Trainer

    step, finish = Trainer.step, MetricsLogger.finish

    def step_then_stop(self):
        step(self)
        if self.state["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    def stop_again_then_finish(self, summary):
        os.kill(os.getpid(), signal.SIGTERM)
        finish(self, summary)

    monkeypatch.setattr(Trainer, "step", step_then_stop)
    monkeypatch.setattr(MetricsLogger, "finish", stop_again_then_finish)
    leaked = []  # signals that reached the handler outside the trainer's (by default they would kill the run)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: leaked.append(signum))
    try:
        run_train(small_cfg("trainer.max_steps=50", "trainer.val_every=0", "trainer.save_every=0"), tmp_path)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert leaked == []
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stopped_by_signal"] and summary["step"] == 2
    assert (tmp_path / "checkpoints" / "step_00000002").is_dir()
