"""benchmarks/needle_curriculum.py on CPU: two tiny stages, the second from the first's weights, the final RULER report
and the tables; finished stages skipped, interrupted ones resumed, a failing one ending its family."""
import json

import pytest
import yaml

from benchmarks import needle_curriculum as nc

TINY = ["--size", "tiny", "--batch-sizes", "4,2", "--steps", "3,2", "--lengths", "132,256", "--eval-lengths", "138,262",
        "--eval-tasks", "niah_single_1", "--eval-samples", "2"]
OVERRIDES = ["--", "trainer.device=cpu", "logger=none", "trainer.val_every=2"]


def test_stages_chain_by_init_from_then_ruler_and_tables(tmp_path, capsys):
    out = tmp_path / "cur"
    assert nc.main(["--out", str(out), "--families", "transformer", *TINY, *OVERRIDES]) == 0
    first, second = out / "transformer-T132", out / "transformer-T256"
    cfg1, cfg2 = (yaml.safe_load((d / "config.yaml").read_text()) for d in (first, second))
    assert cfg1["trainer"]["init_from"] is None and cfg1["optim"]["warmup_steps"] == nc.FIRST_WARMUP
    assert cfg2["trainer"]["init_from"] == str(first) and cfg2["optim"]["warmup_steps"] == nc.STAGE_WARMUP
    assert (cfg1["trainer"]["seq_len"], cfg2["trainer"]["seq_len"]) == (132, 256)
    assert cfg2["data"]["retrieval_mix"]["fraction"] == 1.0 and cfg2["trainer"]["early_stop_metric"] == "val/needle_acc"
    assert json.loads((second / "summary.json").read_text())["evals"]["ruler"]["json"].endswith("ruler_T262/ruler.json")
    report = json.loads((out / "transformer-ruler" / "ruler.json").read_text())
    assert report["lengths"] == [138, 262] and report["tasks"] == ["niah_single_1"]
    assert report["checkpoint"].startswith(str(second))
    text = capsys.readouterr().out
    assert "| transformer | 132 | 3 | max steps |" in text and "| transformer | 256 | 2 | max steps |" in text
    assert "| transformer | niah_single_1 | " in text and "| 138 | 262 |" in text
    assert (out / "needle_curriculum.md").read_text() == text

    stamps = {p: p.stat().st_mtime_ns for p in (first / "summary.json", second / "summary.json",
                                                 out / "transformer-ruler" / "ruler.json")}
    assert nc.main(["--out", str(out), "--families", "transformer", *TINY, *OVERRIDES]) == 0
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # everything had ended: nothing ran again


def test_interrupted_stage_resumes_and_finished_ones_are_skipped(tmp_path, monkeypatch):
    out = tmp_path / "cur"
    for length, summary in ((132, {"step": 3}), (256, {"step": 1, "stopped_by_signal": True})):
        (out / f"mamba2-T{length}").mkdir(parents=True)
        (out / f"mamba2-T{length}" / "summary.json").write_text(json.dumps(summary))
    calls = []
    monkeypatch.setattr(nc.Curriculum, "_call", lambda self, cmd, folder, log, family: calls.append(cmd) or True)
    argv = ["--out", str(out), "--families", "mamba2", *TINY, "--family-lr", "mamba2=5e-4",
            "--train-tasks", "niah_single_1,niah_multikey_1", "--", "logger=none",
            "trainer.val_every=2"]
    assert nc.main(argv) == 0
    stage, ruler = calls  # the T132 stage had ended; T256 is run again (train.py resumes it), then the report
    assert "trainer.seq_len=256" in stage and f"trainer.init_from={out / 'mamba2-T132'}" in stage
    assert "eval=ruler" in ruler and f"checkpoint={out / 'mamba2-T256'}" in ruler
    assert stage[-2:] == ["logger=none", "trainer.val_every=2"]  # after the curriculum's own overrides
    assert "optim.lr=0.0005" in stage and "optim.lr=0.001" not in stage
    assert "data.retrieval_mix.tasks=[niah_single_1,niah_multikey_1]" in stage
    assert "trainer.final_evals.ruler.tasks=[niah_single_1,niah_multikey_1]" in stage
    assert "logger=none" in ruler and "trainer.val_every=2" not in ruler  # the report takes the logger's only


def test_a_failing_stage_ends_its_family_and_the_exit_status(tmp_path, capsys):
    out = tmp_path / "cur"
    argv = ["--out", str(out), "--families", "transformer", *TINY[:2], "--lengths", "132,256", "--batch-sizes", "0,2",
            "--steps", "1,1", *OVERRIDES]
    assert nc.main(argv) == 1
    err = capsys.readouterr().err
    assert "transformer: failed" in err and str(out / "transformer-T132" / "stage.log") in err
    assert not (out / "transformer-T256").exists() and not (out / "transformer-ruler").exists()


def test_bad_arguments_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        nc.main(["--out", str(tmp_path), "--families", "transformer", "--lengths", "132,256", "--batch-sizes", "4"])
    assert "one value a stage" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        nc.main(["--out", str(tmp_path), "--families", "no_such_model"])
    assert "unknown model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        nc.main(["--out", str(tmp_path), "--families", "transformer", "--family-lr", "mamba2=5e-4"])
    assert "not in --families" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        nc.main(["--out", str(tmp_path), "--families", "transformer", "--family-lr", "transformer:5e-4"])
    assert "expected family=lr" in capsys.readouterr().err


def test_tables_mark_unfinished_and_interrupted_stages(tmp_path):
    (tmp_path / "gated_deltanet-T132").mkdir()
    (tmp_path / "gated_deltanet-T132" / "metrics.jsonl").write_text(
        json.dumps({"step": 100, "val/needle_acc": 0.25, "val/needle_token_acc": 0.5}) + "\n{\"step\": 1")
    (tmp_path / "gated_deltanet-T256").mkdir()
    (tmp_path / "gated_deltanet-T256" / "summary.json").write_text(json.dumps({"step": 7, "stopped_by_signal": True}))
    text = nc.tables(tmp_path, ["gated_deltanet"], [132, 256, 512])
    assert "| gated_deltanet | 132 | 100 | unfinished | 0.250 | 0.500 | - |" in text
    assert "| gated_deltanet | 256 | 7 | interrupted | - | - | - |" in text
    assert "| 512 |" not in text  # a stage never started has no row
