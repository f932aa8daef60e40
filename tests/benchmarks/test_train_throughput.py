"""benchmarks/train_throughput.py on CPU: tiny families at two sequence lengths, a few real training steps each.

The table must hold one row per (family, size, seq_len) with the batch size --tokens-per-step implies and a
step-time breakdown whose shares are positive and add up to at most the whole step; an out-of-memory
configuration must become an OOM row while the others still run.
"""
import json
import re
from pathlib import Path

import pytest

import benchmarks.train_throughput as tt

MODELS, SEQ_LENS, TOKENS = ("transformer", "mamba2"), (32, 64), 128
ARGS = ["--models", *MODELS, "--sizes", "tiny", "--seq-lens", *map(str, SEQ_LENS), "--tokens-per-step", str(TOKENS),
        "--steps", "2", "trainer.device=cpu"]


def table_rows(text):
    """The markdown table's data rows as lists of cells (header and separator dropped)."""
    lines = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| model ")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


def percent(cell):
    assert re.fullmatch(r"\d+\.\d%", cell), cell
    return float(cell[:-1])


@pytest.fixture(scope="module")
def run():
    results = tt.main(ARGS)
    return results, tt.table(results)


def test_one_row_per_family_and_seq_len_with_breakdown(run):
    results, text = run
    rows = table_rows(text)
    assert [(r[0], r[1], int(r[2]), int(r[3])) for r in rows] == [
        (m, "tiny", t, TOKENS // t) for m in MODELS for t in SEQ_LENS]
    for r, res in zip(rows, results):
        assert res["status"] == "ok"
        assert float(r[4].replace(",", "")) > 0 and r[5] == "n/a"  # tokens/s; MFU unknown on CPU
        assert float(r[6]) > 0 and float(r[7]) > 0  # peak memory, ms/step
        data_wait, *phases = (percent(c) for c in r[8:12])
        assert data_wait >= 0 and all(p > 0 for p in phases), r
        assert data_wait + sum(phases) <= 100.0 + 0.2, r  # rounding of four cells
        assert res["step_ms"] > 0 and res["forward_frac"] + res["backward_frac"] + res["optimizer_frac"] <= 1.0


def _write_one_step_metrics(run_dir):
    """What a one-step training.trainer.run leaves in run_dir/metrics.jsonl (0.5 s a step, split 10/20/40/10%)."""
    row = {"step": 1, "train/loss": 1.0, "perf/tokens_per_s": 10.0, "perf/step_time_s": 0.5,
           "perf/data_wait_frac": 0.1, "perf/forward_s": 0.1, "perf/backward_s": 0.2, "perf/optimizer_s": 0.05,
           "perf/mem_peak_gib": 1.0}
    (Path(run_dir) / "metrics.jsonl").write_text(json.dumps(row) + "\n")


def test_oom_is_a_row_and_the_rest_still_run(monkeypatch, capsys):
    import torch

    from training import trainer

    calls = []

    def fake_run(cfg, run_dir):
        calls.append((cfg.model.name, int(cfg.trainer.seq_len), int(cfg.trainer.batch_size)))
        if cfg.trainer.seq_len == 64:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        _write_one_step_metrics(run_dir)
        return {}

    monkeypatch.setattr(trainer, "run", fake_run)
    results = tt.main(["--model", "transformer", "--sizes", "tiny", "--seq-len", "32", "64", "--batch-size", "3",
                       "--steps", "2"])
    assert calls == [("transformer", 32, 3), ("transformer", 64, 3)]
    assert [r["status"] for r in results] == ["ok", "OOM"]
    rows = table_rows(tt.table(results))
    assert rows[1][:5] == ["transformer", "tiny", "64", "3", "OOM"]
    assert rows[0][7:12] == ["500.0", "10.0%", "20.0%", "40.0%", "10.0%"]  # ms/step, then shares of 0.5 s
    assert "| transformer | tiny | 64 | 3 | OOM |" in capsys.readouterr().out  # the printed table


def test_tokens_per_step_must_fit_one_row():
    with pytest.raises(SystemExit):
        tt.parse_args(["--seq-lens", "2048", "--tokens-per-step", "1024"])
    with pytest.raises(SystemExit):
        tt.parse_args(["--batch-size", "4", "--tokens-per-step", "8192"])
    defaults = tt.parse_args([])
    assert defaults.models == list(tt.FAMILIES) and defaults.seq_lens == [2048, 8192, 16384]
    assert defaults.tokens_per_step == 32768 and defaults.batch_size is None


def test_overrides_anywhere_and_unknown_models():
    """key=value words are Hydra overrides wherever they stand (after --models they used to be taken as model
    names); a model name without conf/model/<name>.yaml is an error naming the choices."""
    args = tt.parse_args(["--models", "mamba2", "trainer.grad_accum=32", "--seq-lens", "128", "model.x=1"])
    assert args.models == ["mamba2"] and args.seq_lens == [128]
    assert args.overrides == ["trainer.grad_accum=32", "model.x=1"]
    with pytest.raises(SystemExit):
        tt.parse_args(["--models", "mamba3"])


@pytest.mark.parametrize("argv, says", [
    (["--sizes", "huge"], "unknown size(s) ['huge']: presets are conf/model/size"),
    (["--seq-lens", "2048", "-5"], "--seq-lens must be positive"),
    (["--steps", "0"], "--steps must be >= 1"),
])
def test_bad_sizes_lengths_and_steps_are_named(capsys, argv, says):
    """A preset without conf/model/size/<name>.yaml, a non-positive length or step count is refused before any model
    is built, with a message that names it (a missing preset used to surface as Hydra's config-search dump)."""
    with pytest.raises(SystemExit):
        tt.parse_args(["--models", "mamba2", *argv])
    assert says in capsys.readouterr().err
    assert tt.parse_args(["--models", "mamba2", "--sizes", "tiny", "760m", "--steps", "1"]).sizes == ["tiny", "760m"]


def test_accumulation_shows_in_the_batch_column():
    row = {"model": "mamba2", "size": "760m", "seq_len": 16384, "batch_size": 1, "grad_accum": 32, "status": "ok",
           "tokens_per_s": 1000.0, "mfu": None, "mem_peak_gib": 1.0, "step_ms": 10.0, "final_loss": 1.0,
           "compiled": True, **{f"{p}_frac": 0.1 for p in tt.PHASES}}
    assert "| mamba2 | 760m | 16384 | 1x32 | 1,000 |" in tt.table([row])
    assert "| mamba2 | 760m | 16384 | 1 | 1,000 |" in tt.table([{**row, "grad_accum": 1}])


def test_fused_projections_flag_reaches_the_model_config(monkeypatch):
    """--fused-projections becomes model.fused_projections of the runs."""
    from training import trainer

    seen = []

    def fake_run(cfg, run_dir):
        seen.append(cfg.model.get("fused_projections"))
        _write_one_step_metrics(run_dir)
        return {}

    monkeypatch.setattr(trainer, "run", fake_run)
    common = ["--model", "gated_deltanet", "--sizes", "tiny", "--seq-len", "32", "--batch-size", "1", "--steps", "1"]
    tt.main(common)
    tt.main([*common, "--fused-projections"])
    assert seen == [None, True]
