"""benchmarks/eval_compare.py: several runs' perplexity-by-position and RULER reports in one figure and one table,
read from the files the evaluations write."""
import math

import pytest
import torch
import yaml
from torch import nn

from benchmarks.eval_compare import main
from eval_suites import ppl_by_position
from eval_suites.ruler import report as ruler_report

VOCAB = 11


class BigramModel(nn.Module):
    """A fixed next-token distribution per current token: a model whose per-position NLL is known."""

    def __init__(self, seed: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)))

    def forward(self, input_ids):
        return self.table[input_ids]


def _ruler(scores: dict[str, dict[str, float]]) -> dict:
    tasks, lengths = list(scores), [int(n) for n in next(iter(scores.values()))]
    by_task = {t: sum(s.values()) / len(s) for t, s in scores.items()}
    by_length = {str(n): sum(scores[t][str(n)] for t in tasks) / len(tasks) for n in lengths}
    return {"suite": "ruler", "tasks": tasks, "lengths": lengths, "num_samples": 4, "scores": scores,
            "average_by_task": by_task, "average_by_length": by_length, "average": sum(by_task.values()) / len(tasks)}


def _make_run(root, name, seed, ruler_scores, config=True):
    docs = torch.randint(0, VOCAB, (6, 33), generator=torch.Generator().manual_seed(100))
    results = {}
    for seq_len in (16, 32):
        result = ppl_by_position.evaluate(BigramModel(seed), docs, seq_len=seq_len, train_len=16, smooth_window=4)
        ppl_by_position.write_report(result, root / name / "eval" / f"ppl_by_position_T{seq_len}")
        results[seq_len] = result
    ruler_report.write_report(_ruler(ruler_scores), root / name / "eval" / "ruler_T64-128")
    if config:
        (root / name / "config.yaml").write_text(yaml.safe_dump({"model": {"name": f"model_{name}"}}))
    return results


def _row(text, label):
    return next(line for line in text.splitlines() if line.startswith(f"| {label} |")).strip("| ").split(" | ")


def test_tables_and_figure_from_two_runs(tmp_path):
    a = _make_run(tmp_path, "a", 0, {"niah_single_1": {"64": 100.0, "128": 50.0}, "niah_single_2": {"64": 25.0, "128": 0.0}})
    b = _make_run(tmp_path, "b", 1, {"niah_single_1": {"64": 75.0, "128": 0.0}, "niah_single_2": {"64": 0.0, "128": 0.0}},
                  config=False)
    main([str(tmp_path / "a"), f"named_b={tmp_path / 'b'}", "--out", str(tmp_path / "cmp")])
    text = (tmp_path / "cmp" / "eval_compare.md").read_text()
    assert (tmp_path / "cmp" / "ppl_by_position.png").stat().st_size > 0

    # The label is model.name from the run's config.yaml, else the NAME= given.
    sections = text.split("Perplexity by position at ")
    assert sections[1].startswith("16 tokens") and sections[2].startswith("32 tokens")
    for label, results in (("model_a", a), ("named_b", b)):
        row16 = _row(sections[1], label)
        assert float(row16[1]) == pytest.approx(results[16]["ppl"], abs=0.006)
        # Past the training length (16 of 32 positions) the 32-token table splits the ppl at it.
        row32 = _row(sections[2], label)
        assert float(row32[2]) == pytest.approx(results[32]["ppl_before_train_len"], abs=0.006)
        assert float(row32[3]) == pytest.approx(results[32]["ppl_after_train_len"], abs=0.006)
        buckets = results[32]["log2_buckets"]
        assert [float(c) for c in row32[4:]] == pytest.approx([b["ppl"] for b in buckets], abs=0.006)
    header32 = next(line for line in sections[2].splitlines() if line.startswith("| run |"))
    assert "[8, 16)" in header32 and "ppl > train len" in header32
    assert not math.isclose(a[32]["ppl"], b[32]["ppl"])  # the two runs' rows differ

    ruler = text.split("RULER")[1]
    head = next(line for line in ruler.splitlines() if line.startswith("| run |")).strip("| ").split(" | ")
    assert head == ["run", "niah_single_1 @ 64", "niah_single_1 @ 128", "niah_single_2 @ 64", "niah_single_2 @ 128",
                    "average"]
    assert _row(ruler, "model_a") == ["model_a", "100.0", "50.0", "25.0", "0.0", "43.8"]
    assert _row(ruler, "named_b") == ["named_b", "75.0", "0.0", "0.0", "0.0", "18.8"]


def test_a_directory_without_reports_is_named(tmp_path):
    (tmp_path / "empty" / "eval").mkdir(parents=True)
    with pytest.raises(SystemExit, match="holds no"):
        main([str(tmp_path / "empty"), "--out", str(tmp_path / "cmp")])
    with pytest.raises(SystemExit, match="not a directory"):
        main([str(tmp_path / "missing"), "--out", str(tmp_path / "cmp")])
