"""What a training run says on the console: a line per log window (step, loss, lr, tokens/s, MFU, memory) with or
without the progress bar, a line per validation (its loss; MQAR accuracy), the progress of a long validation, what
an MQAR validation covers (every test example, or trainer.val_batches of each slice), and libraries' INFO records
kept in train.log, off the console."""
import re
import subprocess
import sys

import pytest

from tests.training.helpers import REPO, SMALL, metrics, run_train, small_cfg
from tests.training.test_mqar_train import TINY_DATA

WINDOW = re.compile(r"^step (\d+)/(\d+) \| loss \d+\.\d{4} \| lr \d\.\d\de[-+]\d\d \| grad_norm \d+\.\d{3} \| "
                    r"[\d.]+[KMG]? tokens/s \| MFU \d+\.\d% \| mem \d+\.\d\d GiB$")
VALIDATION = re.compile(r"^val step (\d+) \| loss (\d+\.\d{4}) \| [\d.]+ s$")


def _lines(text):
    return [line.strip() for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("bar", [False, True])
def test_each_log_window_and_validation_prints_one_line(tmp_path, capsys, bar):
    """With the bar on the lines go through tqdm's write: whole lines on stdout, the bar on stderr."""
    summary = run_train(small_cfg("trainer.log_every=2", f"trainer.progress_bar={str(bar).lower()}",
                                  "trainer.peak_tflops=1"), tmp_path / "run")
    out, err = capsys.readouterr()
    lines = _lines(out)
    windows = [WINDOW.match(line) for line in lines if line.startswith("step ")]
    assert all(windows), lines
    assert [int(m.group(1)) for m in windows] == [2, 4, 6] and {m.group(2) for m in windows} == {"6"}
    vals = [VALIDATION.match(line) for line in lines if line.startswith("val step")]
    assert all(vals), lines
    assert [int(m.group(1)) for m in vals] == [0, 3, 6]
    logged = {r["step"]: r["val/loss"] for r in metrics(tmp_path / "run") if "val/loss" in r}
    for m in vals:
        assert float(m.group(2)) == pytest.approx(logged[int(m.group(1))], abs=1e-4)
    assert float(vals[-1].group(2)) == pytest.approx(summary["val_loss"], abs=1e-4)
    assert "validation: 8 held-out rows of 64 tokens (trainer.val_batches=2 batches of 4)" in lines
    assert ("train:" in err) == bar  # the bar, when on, is on stderr and nothing of it on stdout
    assert "|#" not in out and "it/s" not in out
    assert "Writing model shards" not in err  # transformers' bar at each checkpoint is off


def test_mqar_validates_every_test_example_by_default_and_says_so(tmp_path, capsys, monkeypatch):
    """The Zoology protocol's full test sets (val_batches null), announced, with progress lines when it runs long
    (here every batch: PROGRESS_EVERY_S = 0) and the accuracy on the validation line."""
    import training.validation

    monkeypatch.setattr(training.validation, "PROGRESS_EVERY_S", 0.0)
    run_train(small_cfg(*TINY_DATA, "model=transformer", "trainer.max_steps=3"), tmp_path / "run")
    lines = _lines(capsys.readouterr().out)
    assert ("validation: MQAR, 2 test slice(s), 128 examples (every test example, the Zoology protocol; "
            "trainer.val_batches=N scores the first N batches of each slice instead)") in lines
    progress = [line for line in lines if line.startswith("val: ")]
    assert progress and progress[0].startswith("val: 4/128 examples (3%), ")
    assert any(line.startswith("val: 124/128 examples") for line in progress)
    vals = [line for line in lines if line.startswith("val step")]
    assert len(vals) == 2  # steps 0 and 3
    assert re.match(r"^val step 0 \| loss \d+\.\d{4} \| mqar_acc \d\.\d{4} \| T16_kv2 \d\.\d{3} T16_kv4 \d\.\d{3} \| ",
                    vals[0]), vals[0]


def test_mqar_val_batches_scores_the_first_batches_of_each_slice(tmp_path, capsys, monkeypatch):
    from eval_suites import mqar

    sizes = []
    evaluate = mqar.evaluate

    def recording(model, test_sets, *args, **kwargs):
        sizes.append([len(t["inputs"]) for t in test_sets])
        return evaluate(model, test_sets, *args, **kwargs)

    monkeypatch.setattr(mqar, "evaluate", recording)
    run_train(small_cfg(*TINY_DATA, "model=transformer", "trainer.max_steps=3", "trainer.val_batches=3"),
              tmp_path / "run")
    assert sizes == [[12, 12], [12, 12]]  # 3 batches of 4 per slice, at steps 0 and 3
    lines = _lines(capsys.readouterr().out)
    assert ("validation: MQAR, the first 12 examples of each of 2 test slice(s), 24 in all (trainer.val_batches=3: "
            "val/mqar_acc is the accuracy on this subset; eval=mqar scores the full test sets)") in lines


def test_library_info_stays_in_train_log_off_the_console(tmp_path):
    """train.py (Hydra's logging): accelerate's INFO lines at each checkpoint reach train.log, not the console."""
    run_dir = tmp_path / "run"
    res = subprocess.run([sys.executable, "train.py", *SMALL, "trainer.max_steps=3", f"hydra.run.dir={run_dir}"],
                         cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    console = res.stdout + res.stderr
    assert "Saving current state" not in console and "[INFO]" not in console
    assert "Saving current state" in (run_dir / "train.log").read_text()
    assert "val step 3 | loss" in res.stdout and re.search(r"^step 3/3 \| loss ", res.stdout, re.MULTILINE)
