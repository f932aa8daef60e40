"""metrics.jsonl survives torn writes: whole lines on write, a torn last line dropped on read and on resume."""
import errno
import json
import logging

import pytest
from omegaconf import OmegaConf

from training import logging as metrics_logging
from training.logging import MetricsLogger, read_metrics

ROWS = [{"step": s, "train/loss": 4.0 - s / 10} for s in range(1, 4)]


def write_rows(path, rows, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return path


def logger_for(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return MetricsLogger(tmp_path, OmegaConf.create({"logger": {"mode": "disabled"}}), enabled=True)


def test_torn_last_line_is_dropped_with_a_warning_naming_the_file(tmp_path, caplog):
    path = write_rows(tmp_path / "metrics.jsonl", ROWS, tail='{"step": 4, "train/lo')
    with caplog.at_level(logging.WARNING, logger="training.logging"):
        assert read_metrics(path) == ROWS
    assert any("torn last line" in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)


def test_whole_last_line_without_newline_is_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]) + json.dumps(ROWS[2]))
    assert read_metrics(path) == ROWS


def test_corrupt_middle_line_raises_naming_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(ROWS[0]) + '\n{"step": 2, "train/lo\n' + json.dumps(ROWS[2]) + "\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl: line 2 is not valid JSON"):
        read_metrics(path)


def test_resume_cuts_a_torn_line_before_appending(tmp_path, monkeypatch, caplog):
    path = write_rows(tmp_path / "metrics.jsonl", ROWS, tail='{"step": 4, "train/lo')
    with caplog.at_level(logging.WARNING, logger="training.logging"):
        logger = logger_for(tmp_path, monkeypatch)
    assert any(str(path) in r.getMessage() for r in caplog.records)
    logger.log({"train/loss": 3.5}, step=4)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="training.logging"):
        assert read_metrics(path) == [*ROWS, {"step": 4, "train/loss": 3.5}]
    assert not caplog.records  # nothing torn is left


def test_a_full_disk_leaves_whole_lines_and_says_so(tmp_path, monkeypatch):
    logger = logger_for(tmp_path, monkeypatch)
    logger.log({"train/loss": 4.0}, step=1)
    before = logger.jsonl.read_bytes()
    real_write = metrics_logging.os.write

    def full_disk(fd, data):  # half the line reaches the disk, then ENOSPC
        real_write(fd, bytes(data[:len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(metrics_logging.os, "write", full_disk)
    with pytest.raises(OSError, match=r"metrics\.jsonl.*disk full"):
        logger.log({"train/loss": 3.9, "note": "x" * 100}, step=2)
    assert logger.jsonl.read_bytes() == before
    monkeypatch.setattr(metrics_logging.os, "write", real_write)
    logger.log({"train/loss": 3.8}, step=3)
    assert [r["step"] for r in read_metrics(logger.jsonl)] == [1, 3]


def test_each_line_is_one_write(tmp_path, monkeypatch):
    logger = logger_for(tmp_path, monkeypatch)
    calls = []
    real_write = metrics_logging.os.write
    monkeypatch.setattr(metrics_logging.os, "write", lambda fd, data: calls.append(bytes(data)) or real_write(fd, data))
    logger.log({"train/loss": 1.0, "blob": "y" * 20000}, step=7)  # longer than any stdio buffer
    assert len(calls) == 1 and calls[0].endswith(b"\n") and json.loads(calls[0])["step"] == 7


def test_a_resume_moves_the_discarded_steps_records_aside(tmp_path):
    """A run that falls back to an older checkpoint (here: its newest one removed) logs each step once in
    metrics.jsonl; the records of the discarded training go to metrics.superseded.jsonl, not lost."""
    import shutil

    from tests.training.helpers import metrics, run_train, small_cfg

    run_dir = tmp_path / "run"
    run_train(small_cfg("trainer.max_steps=6", "trainer.save_every=3", "trainer.val_every=0"), run_dir)
    first = metrics(run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000006")
    (run_dir / "checkpoints" / "latest").write_text("step_00000003")
    run_train(small_cfg("trainer.max_steps=6", "trainer.save_every=3", "trainer.val_every=0"), run_dir)
    steps = [r["step"] for r in metrics(run_dir) if "train/loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    from training.logging import read_metrics

    superseded = read_metrics(run_dir / "metrics.superseded.jsonl")
    assert superseded == [r for r in first if r["step"] > 3]


def test_a_summary_write_that_fails_leaves_the_previous_summary_whole(tmp_path, monkeypatch):
    logger = logger_for(tmp_path, monkeypatch)
    monkeypatch.setattr(metrics_logging, "plot_loss_curve", lambda *a: None)
    logger.finish({"step": 3, "stopped_by_signal": True})
    before = (tmp_path / "summary.json").read_text()

    def fail(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("training.checkpoint.os.fsync", fail)  # the write dies before the file is replaced
    with pytest.raises(OSError):
        logger.finish({"step": 5, "stopped_by_signal": False})
    assert (tmp_path / "summary.json").read_text() == before
