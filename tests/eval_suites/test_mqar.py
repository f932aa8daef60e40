"""MQAR accuracy (eval_suites/mqar.py) and the label convention end to end, with oracle "models"."""

import pytest
import torch
from torch import nn

from data.mqar import IGNORE_INDEX, MQARLoader, build_test_sets, derived_seed, generate, slice_name
from eval_suites import mqar
from models import HiloForCausalLM

VOCAB = 256


class Out:
    def __init__(self, logits):
        self.logits = logits


class Recall(nn.Module):
    """Associative memory read from the inputs alone: at position t holding token k, predict the token that followed
    the first earlier occurrence of k at an even position (the key-value block comes first, so that is k's value).
    lag shifts where the prediction is written (lag 0: at the key's position, the protocol; lag 1: one late)."""

    def __init__(self, lag=0):
        super().__init__()
        self.lag = lag
        self.anchor = nn.Parameter(torch.zeros(()))  # evaluate() reads the device from the parameters

    def forward(self, input_ids, use_cache=False, **kwargs):
        b, t = input_ids.shape
        logits = torch.zeros(b, t, VOCAB)
        for r, row in enumerate(input_ids.tolist()):
            first = {}
            for s in range(0, t - 1, 2):
                first.setdefault(row[s], (s, row[s + 1]))
            for pos, tok in enumerate(row):
                if tok in first and first[tok][0] + 1 < pos and pos + self.lag < t:
                    logits[r, pos + self.lag, first[tok][1]] = 30.0
        return Out(logits)


class Constant(Recall):
    def forward(self, input_ids, use_cache=False, **kwargs):
        logits = torch.zeros(*input_ids.shape, VOCAB)
        logits[..., VOCAB // 2] = 30.0
        return Out(logits)


CFG = {"type": "mqar", "vocab_size": VOCAB, "train": [{"seq_len": 32, "num_kv_pairs": 4, "num_examples": 16}],
       "test_seed": 3, "test": [{"seq_len": 32, "num_kv_pairs": 4, "num_examples": 20},
                                {"seq_len": 48, "num_kv_pairs": 12, "num_examples": 10}]}


def test_oracle_scores_everything_and_constant_nothing():
    tests = build_test_sets(CFG)
    result = mqar.evaluate(Recall(), tests, batch_size=7, device="cpu")
    assert result["acc"] == 1.0 and result["num_queries"] == 20 * 4 + 10 * 12
    assert set(result["slices"]) == {"T32_kv4", "T48_kv12"}
    assert all(s["acc"] == 1.0 and s["loss"] < 1e-6 for s in result["slices"].values())
    assert result["slices"]["T48_kv12"]["num_queries"] == 120
    constant = mqar.evaluate(Constant(), tests, batch_size=64, device="cpu")
    assert constant["acc"] < 0.05 and constant["loss"] > 10
    late = mqar.evaluate(Recall(lag=1), tests, batch_size=64, device="cpu")  # predicting one position late
    assert late["acc"] < 0.05


def test_partial_credit_is_per_example_and_averaged_over_examples():
    tests = build_test_sets(CFG)
    recall = Recall()

    class HalfWrong(Recall):
        """The oracle, but wrong on slice T48 for every query whose key is odd."""

        def forward(self, input_ids, use_cache=False, **kwargs):
            logits = recall(input_ids).logits
            if input_ids.shape[1] == 48:
                wrong = (input_ids % 2 == 1).unsqueeze(-1) & (logits.max(-1, keepdim=True).values > 0)
                logits = torch.where(wrong, logits.roll(1, dims=-1), logits)
            return Out(logits)

    result = mqar.evaluate(HalfWrong(), tests, batch_size=4, device="cpu")
    t48 = tests[1]
    query = t48["labels"] != IGNORE_INDEX
    expected_48 = (t48["inputs"][query] % 2 == 0).double().mean().item()
    assert result["slices"]["T48_kv12"]["acc"] == pytest.approx(expected_48)
    assert result["slices"]["T32_kv4"]["acc"] == 1.0
    # overall, Zoology's accuracy: each example's accuracy, averaged over the examples
    # of all slices; query_acc pools the queries instead, so the slice with more pairs weighs more
    per_example_48 = ((t48["inputs"] % 2 == 0) & query).sum(-1).double() / query.sum(-1)
    assert result["acc"] == pytest.approx((20 * 1.0 + per_example_48.sum().item()) / 30)
    assert result["query_acc"] == pytest.approx((80 + expected_48 * 120) / 200)
    assert result["acc"] != pytest.approx(result["query_acc"])
    assert result["num_examples"] == 30 and result["slices"]["T48_kv12"]["num_examples"] == 10
    flat = mqar.metrics(result)
    assert flat["val/mqar_acc"] == result["acc"] and flat["val/mqar_acc/T48_kv12"] == pytest.approx(expected_48)
    assert flat["val/mqar_query_acc"] == result["query_acc"]
    *_, overall, pooled = mqar.format_table(result).splitlines()
    assert overall.split() == ["all", f"{100 * result['acc']:.2f}", "200"]
    assert pooled.split() == ["all,", "per", "query", f"{100 * result['query_acc']:.2f}", "200"]
    assert flat["val/loss"] == result["loss"]


def test_training_labels_make_the_model_loss_score_the_query_positions():
    """The loader's labels through the model's own (shifting) loss: the oracle that answers at the query position
    has ~0 loss; answering one position late, or the generator's unshifted labels, does not."""
    loader = MQARLoader(CFG, batch_size=8, seed=0)
    batch = next(loader)
    oracle = Recall()(batch["input_ids"]).logits
    assert HiloForCausalLM.loss(oracle, batch["labels"]).item() < 1e-6
    late = Recall(lag=1)(batch["input_ids"]).logits
    assert HiloForCausalLM.loss(late, batch["labels"]).item() > 5
    unshifted = batch["labels"].roll(-1, dims=1)  # the generator's labels (value at the query position)
    assert ((unshifted != IGNORE_INDEX).sum(1) == 4).all()
    assert HiloForCausalLM.loss(oracle, unshifted).item() > 5
    # and the loader's labels are exactly the generated examples' labels, moved one position right
    inputs, labels = generate(16, 32, 4, vocab_size=VOCAB, seed=derived_seed(0, 0, 0))
    rows = [inputs.tolist().index(row) for row in batch["input_ids"].tolist()]
    assert torch.equal(unshifted, labels[rows])


def test_evaluate_restores_training_mode_and_checks_inputs():
    model = Recall().train()
    mqar.evaluate(model, build_test_sets(CFG), batch_size=64)
    assert model.training
    with pytest.raises(ValueError, match="no MQAR test sets"):
        mqar.evaluate(model, [], batch_size=4)
    assert slice_name(256, 64) == "T256_kv64"


def test_logits_are_asked_for_at_the_queried_positions_only():
    """evaluate passes logits_to_keep = the positions some row of the batch queries; a model that keeps them and one
    that returns every position score the same."""
    tests = build_test_sets(CFG)
    full = Recall()
    seen = []

    class Keeping(Recall):
        def forward(self, input_ids, use_cache=False, logits_to_keep=0, **kwargs):
            logits = full(input_ids).logits
            seen.append((input_ids.shape[1], len(logits_to_keep)))
            return Out(logits[:, logits_to_keep])

    class HalfWrongKeeping(Keeping):  # wrong on odd keys: partial credit, so a misread position would show
        def forward(self, input_ids, use_cache=False, logits_to_keep=0, **kwargs):
            logits = full(input_ids).logits
            wrong = (input_ids % 2 == 1).unsqueeze(-1) & (logits.max(-1, keepdim=True).values > 0)
            return Out(torch.where(wrong, logits.roll(1, dims=-1), logits)[:, logits_to_keep])

    class HalfWrongFull(Recall):
        def forward(self, input_ids, use_cache=False, **kwargs):
            logits = full(input_ids).logits
            wrong = (input_ids % 2 == 1).unsqueeze(-1) & (logits.max(-1, keepdim=True).values > 0)
            return Out(torch.where(wrong, logits.roll(1, dims=-1), logits))

    kept = mqar.evaluate(Keeping(), tests, batch_size=7, device="cpu")
    assert kept["acc"] == 1.0 and kept["num_queries"] == 20 * 4 + 10 * 12
    assert seen and all(n < t for t, n in seen)  # fewer positions than the sequence
    a = mqar.evaluate(HalfWrongKeeping(), tests, batch_size=7, device="cpu")
    b = mqar.evaluate(HalfWrongFull(), tests, batch_size=7, device="cpu")
    assert 0.2 < a["acc"] < 0.9 and a == b
