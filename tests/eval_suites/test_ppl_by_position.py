"""eval_suites.ppl_by_position against float64 references computed document by document in plain Python."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from eval_suites import ppl_by_position

VOCAB = 11
REPO_ROOT = Path(__file__).resolve().parents[2]


def _random_documents(seed, lengths):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length,), generator=generator).tolist() for length in lengths]


class BigramModel(nn.Module):
    """logits[b, t] = table[input_ids[b, t]]: the next-token distribution depends on the current token only."""

    def __init__(self, seed=0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.table = nn.Parameter(3 * torch.randn(VOCAB, VOCAB, generator=generator), requires_grad=False)
        self.calls = []

    def forward(self, input_ids):
        self.calls.append(input_ids.clone())
        return SimpleNamespace(logits=self.table[input_ids])

    def reference_row(self, prefix):
        return self.table[prefix[-1]].double().tolist()


class PrefixModel(BigramModel):
    """logits[b, t] = table[(sum(input_ids[b, :t + 1]) + t) % V]: every prediction depends on the whole row up
    to t and on t itself, so packing documents together, shifting them, or padding changes the answer."""

    def forward(self, input_ids):
        self.calls.append(input_ids.clone())
        positions = torch.arange(input_ids.shape[1])
        return SimpleNamespace(logits=self.table[(input_ids.cumsum(1) + positions) % VOCAB])

    def reference_row(self, prefix):
        return self.table[(sum(prefix) + len(prefix) - 1) % VOCAB].double().tolist()


def _reference_per_position_nll(model, documents, seq_len):
    """Mean over documents of -log softmax(row)[next token] for each position p = 1..seq_len, in float64,
    each document on its own."""
    per_position = []
    for p in range(1, seq_len + 1):
        nlls = []
        for doc in documents:
            row = model.reference_row(doc[:p])
            log_normaliser = max(row) + math.log(math.fsum(math.exp(x - max(row)) for x in row))
            nlls.append(log_normaliser - row[doc[p]])
        per_position.append(math.fsum(nlls) / len(nlls))
    return per_position


def _mean(values):
    return math.fsum(values) / len(values)


@pytest.mark.parametrize("chunk_elements", [2**25, 1, 3 * 2 * VOCAB])
def test_per_position_nll_matches_float64_reference(monkeypatch, chunk_elements):
    # chunk_elements 1 normalises one position at a time; 3 * 2 * V gives 3-position chunks over a batch of 2 with a
    # ragged last chunk (37 = 12 * 3 + 1).
    monkeypatch.setattr(ppl_by_position, "_CE_CHUNK_ELEMENTS", chunk_elements)
    seq_len = 37
    documents = _random_documents(1, [38, 50, 41, 38, 60])
    model = BigramModel()
    result = ppl_by_position.evaluate(model, documents, seq_len=seq_len, batch_size=2)
    reference = _reference_per_position_nll(model, documents, seq_len)
    assert result["seq_len"] == seq_len
    assert result["num_documents"] == 5
    assert result["num_predictions"] == 5 * seq_len
    assert result["per_position_nll"] == pytest.approx(reference, rel=1e-6, abs=1e-6)
    assert result["nll"] == pytest.approx(_mean(reference), rel=1e-6)


def test_documents_are_not_packed():
    seq_len = 23
    documents = _random_documents(2, [24, 30, 25, 40])
    model = PrefixModel(seed=3)
    result = ppl_by_position.evaluate(model, documents, seq_len=seq_len, batch_size=3)
    reference = _reference_per_position_nll(model, documents, seq_len)
    assert result["per_position_nll"] == pytest.approx(reference, rel=1e-6, abs=1e-6)
    # The model saw exactly the first seq_len tokens of each document, one document per row.
    rows = sorted(row.tolist() for call in model.calls for row in call)
    assert rows == sorted(doc[:seq_len] for doc in documents)


def test_batch_size_does_not_change_result():
    documents = _random_documents(4, [30, 31, 45, 30, 33, 30, 39])
    results = [
        ppl_by_position.evaluate(PrefixModel(seed=5), documents, seq_len=29, batch_size=batch_size, train_len=16)
        for batch_size in (1, 3, 7, 10)
    ]
    for result in results[1:]:
        assert result["num_documents"] == results[0]["num_documents"] == 7
        assert result["per_position_nll"] == pytest.approx(results[0]["per_position_nll"], rel=1e-9, abs=1e-12)
        assert result["ppl"] == pytest.approx(results[0]["ppl"], rel=1e-9)
        assert result["ppl_after_train_len"] == pytest.approx(results[0]["ppl_after_train_len"], rel=1e-9)


def test_buckets_smoothing_and_cumulative_ppl_are_consistent_with_per_position_nll():
    seq_len, train_len, window = 45, 20, 5
    documents = _random_documents(6, [46, 50, 46])
    result = ppl_by_position.evaluate(
        PrefixModel(seed=7), documents, seq_len=seq_len, train_len=train_len, smooth_window=window
    )
    nll = result["per_position_nll"]
    assert len(nll) == seq_len

    def check_bucket(bucket):
        mean = _mean(nll[bucket["start"] - 1 : bucket["end"] - 1])
        assert bucket["nll"] == pytest.approx(mean, rel=1e-12)
        assert bucket["ppl"] == pytest.approx(math.exp(mean), rel=1e-12)

    assert result["linear_bucket_width"] == seq_len // 8 == 5
    assert [(b["start"], b["end"]) for b in result["linear_buckets"]] == [(s, s + 5) for s in range(1, 46, 5)]
    assert [(b["start"], b["end"]) for b in result["log2_buckets"]] == [
        (1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 46)
    ]
    for bucket in result["linear_buckets"] + result["log2_buckets"]:
        check_bucket(bucket)

    for p in range(1, seq_len + 1):
        assert result["cumulative_ppl"][p - 1] == pytest.approx(math.exp(_mean(nll[:p])), rel=1e-12)
        lo, hi = max(0, p - 1 - window // 2), min(seq_len, p - 1 - window // 2 + window)
        assert result["smoothed_nll"][p - 1] == pytest.approx(_mean(nll[lo:hi]), rel=1e-12)
        assert result["smoothed_ppl"][p - 1] == pytest.approx(math.exp(_mean(nll[lo:hi])), rel=1e-12)
    assert result["smooth_window"] == window
    assert result["ppl"] == pytest.approx(math.exp(_mean(nll)), rel=1e-12)
    assert result["ppl"] == pytest.approx(result["cumulative_ppl"][-1], rel=1e-12)
    assert result["train_len"] == train_len
    assert result["ppl_before_train_len"] == pytest.approx(math.exp(_mean(nll[:train_len])), rel=1e-12)
    assert result["ppl_after_train_len"] == pytest.approx(math.exp(_mean(nll[train_len:])), rel=1e-12)


def test_long_sequences_use_2048_wide_linear_buckets():
    seq_len = 4100
    documents = _random_documents(8, [seq_len + 1])
    result = ppl_by_position.evaluate(BigramModel(), documents, seq_len=seq_len, train_len=seq_len)
    assert result["linear_bucket_width"] == 2048
    assert [(b["start"], b["end"]) for b in result["linear_buckets"]] == [(1, 2049), (2049, 4097), (4097, 4101)]
    assert (result["log2_buckets"][-1]["start"], result["log2_buckets"][-1]["end"]) == (4096, 4101)
    assert len(result["log2_buckets"]) == 13
    assert result["smooth_window"] == seq_len // 64
    assert result["ppl_after_train_len"] is None
    assert result["ppl_before_train_len"] == pytest.approx(result["ppl"], rel=1e-12)


@pytest.mark.parametrize("seq_len, width", [(2048, 256), (2049, 2048), (20, 2), (7, 1)])
def test_linear_bucket_width_switches_to_2048_above_2048_positions(seq_len, width):
    result = ppl_by_position.evaluate(BigramModel(), _random_documents(15, [seq_len + 1]), seq_len=seq_len)
    assert result["linear_bucket_width"] == width
    bounds = [(b["start"], b["end"]) for b in result["linear_buckets"]]
    assert bounds == [(s, min(s + width, seq_len + 1)) for s in range(1, seq_len + 1, width)]


def test_too_short_documents_raise_a_clear_error():
    documents = _random_documents(9, [10, 5, 11, 3])
    with pytest.raises(ValueError, match=r"3 of 4 documents have fewer than seq_len \+ 1 = 11 tokens") as info:
        ppl_by_position.evaluate(BigramModel(), documents, seq_len=10)
    assert "min_tokens=11" in str(info.value)
    with pytest.raises(ValueError, match="no document qualifies"):
        ppl_by_position.evaluate(BigramModel(), documents, seq_len=20)
    with pytest.raises(ValueError, match="no documents"):
        ppl_by_position.evaluate(BigramModel(), [], seq_len=10)
    # Documents of exactly seq_len + 1 tokens are enough.
    assert ppl_by_position.evaluate(BigramModel(), documents, seq_len=2)["num_documents"] == 4


def test_write_report_writes_json_and_png(tmp_path):
    documents = _random_documents(10, [70, 66, 80])
    result = ppl_by_position.evaluate(BigramModel(), documents, seq_len=65, train_len=32, batch_size=2)
    json_path, png_path = ppl_by_position.write_report(result, tmp_path / "report", title="bigram")
    assert json.loads(json_path.read_text()) == result
    png = png_path.read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000

    overflowing = dict(result, ppl=math.inf)
    json_path, _ = ppl_by_position.write_report(overflowing, tmp_path / "overflow")
    assert json.loads(json_path.read_text())["ppl"] is None


class AutocastProbe(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)
        self.seen = []

    def forward(self, input_ids):
        self.seen.append((self.training, torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return (self.head(self.embed(input_ids)),)


def test_dtype_runs_the_forward_under_autocast_and_restores_train_mode():
    documents = _random_documents(11, [20, 25])
    model = AutocastProbe().train()
    full = ppl_by_position.evaluate(model, documents, seq_len=19)
    assert model.seen == [(False, False, model.seen[0][2])] * 2 and model.training
    model.seen.clear()
    half = ppl_by_position.evaluate(model, documents, seq_len=19, dtype="bf16")
    assert model.seen == [(False, True, torch.bfloat16)] * 2 and model.training
    assert half["dtype"] == "bfloat16" and full["dtype"] is None
    assert half["nll"] == pytest.approx(full["nll"], rel=2e-2)
    with pytest.raises(ValueError, match="unknown dtype"):
        ppl_by_position.evaluate(model, documents, seq_len=19, dtype="int3")


def test_log_to_wandb_logs_bucket_tables_and_summary():
    documents = _random_documents(12, [40, 41])
    result = ppl_by_position.evaluate(BigramModel(), documents, seq_len=39, train_len=16)
    run = SimpleNamespace(logged=[], summary={})
    run.log = run.logged.append
    ppl_by_position.log_to_wandb(result, run, prefix="eval")
    (logged,) = run.logged
    for kind in ("linear", "log2"):
        table = logged[f"eval/{kind}_buckets"]
        assert table.columns == ["start", "end", "nll", "ppl"]
        assert table.data == [[b["start"], b["end"], b["nll"], b["ppl"]] for b in result[f"{kind}_buckets"]]
        assert f"eval/{kind}_buckets_ppl" in logged
    curve = logged["eval/curve"]
    assert curve.data[0][0] == 1 and curve.data[-1] == [
        39, result["smoothed_nll"][-1], result["smoothed_ppl"][-1], result["cumulative_ppl"][-1]
    ]
    assert run.summary["eval/ppl"] == result["ppl"]
    assert run.summary["eval/ppl_after_train_len"] == result["ppl_after_train_len"]
    assert run.summary["eval/num_documents"] == 2
    ppl_by_position.log_to_wandb(result, None)


def test_import_does_not_load_wandb_or_matplotlib():
    code = "import sys, eval_suites.ppl_by_position; print('wandb' in sys.modules, 'matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    assert out.stdout.split() == ["False", "False"]


def _distributed_worker(rank, world_size, init_file, documents, seq_len, batch_size, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        model = PrefixModel(seed=13)
        result = ppl_by_position.evaluate(model, documents, seq_len=seq_len, batch_size=batch_size)
        result["forward_calls"] = len(model.calls)
        result["rows_seen"] = sum(call.shape[0] for call in model.calls)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_distributed_ranks_split_documents_and_agree(tmp_path):
    # 5 documents over 2 ranks with batch 2: rank 0 evaluates 3 (2 forwards), rank 1 evaluates 2 and must still run
    # a second, uncounted forward so both ranks make the same number of calls.
    documents = _random_documents(14, [18, 20, 18, 25, 19])
    seq_len, world_size = 17, 2
    args = (world_size, str(tmp_path / "init"), documents, seq_len, 2, str(tmp_path))
    mp.spawn(_distributed_worker, args=args, nprocs=world_size, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    reference = _reference_per_position_nll(PrefixModel(seed=13), documents, seq_len)
    for result in ranks:
        assert result["world_size"] == 2 and result["num_documents"] == 5
        assert result["num_predictions"] == 5 * seq_len
        assert result["per_position_nll"] == pytest.approx(reference, rel=1e-6, abs=1e-6)
        assert result["per_position_nll"] == ranks[0]["per_position_nll"]
        assert result["forward_calls"] == 2
    assert [r["rows_seen"] for r in ranks] == [3, 3]
