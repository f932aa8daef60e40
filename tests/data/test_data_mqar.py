"""MQAR data (data/mqar.py): the generator against the protocol written out independently, and the data=mqar loader."""

import io
import json

import numpy as np
import pytest
import torch

from data import build_train_loader
from data.mqar import MQARLoader, build_test_sets, gap_probabilities, generate, model_labels

SHAPES = [(64, 4), (66, 5), (256, 64), (40, 10), (12, 1)]


def check_examples(inputs, labels, seq_len, num_kv_pairs, vocab):
    """The protocol, example by example, with plain Python."""
    split = vocab // 2
    block = 2 * num_kv_pairs
    assert inputs.shape == labels.shape == (inputs.shape[0], seq_len)
    assert inputs.dtype == labels.dtype == torch.long
    for x, y in zip(inputs.tolist(), labels.tolist()):
        keys, values = x[0:block:2], x[1:block:2]
        assert all(1 <= k < split for k in keys) and len(set(keys)) == num_kv_pairs
        assert all(split <= v < vocab for v in values) and len(set(values)) == num_kv_pairs
        pair = dict(zip(keys, values))
        query_positions = [t for t in range(seq_len) if y[t] != -100]
        assert len(query_positions) == num_kv_pairs
        assert all(block <= q <= seq_len - 2 and q % 2 == 0 for q in query_positions)
        assert sorted(x[q] for q in query_positions) == sorted(keys)  # every key queried exactly once
        assert all(y[q] == pair[x[q]] for q in query_positions)
        assert all(0 <= tok < vocab for tok in x)


@pytest.mark.parametrize("seq_len, num_kv_pairs", SHAPES)
def test_examples_follow_the_protocol(seq_len, num_kv_pairs):
    inputs, labels = generate(60, seq_len, num_kv_pairs, vocab_size=8192, seed=3)
    check_examples(inputs, labels, seq_len, num_kv_pairs, 8192)


def test_small_vocabulary_and_fillers():
    inputs, labels = generate(300, 32, 8, vocab_size=20, seed=1)  # 8 of the 9 keys in [1, 10) every time
    check_examples(inputs, labels, 32, 8, 20)
    fill = torch.ones_like(inputs, dtype=torch.bool)
    fill[:, :16] = False
    fill[labels != -100] = False
    fillers = inputs[fill]
    # fillers are uniform over [0, vocab): every token shows up, with frequency near 1/20
    counts = torch.bincount(fillers, minlength=20).double() / fillers.numel()
    assert counts.min() > 0.8 / 20 and counts.max() < 1.2 / 20


def test_query_gaps_follow_the_power_law():
    seq_len, kv, n = 256, 4, 20000
    inputs, labels = generate(n, seq_len, kv, power_a=0.01, seed=0)
    first_key = inputs[:, 0]
    rows, cols = torch.nonzero(labels != -100, as_tuple=True)
    query_of_first = cols[inputs[rows, cols] == first_key[rows]]
    assert query_of_first.numel() == n
    gap_index = (query_of_first - 2 * kv) // 2 + 1  # i = 1 .. (T - 2n) / 2
    slots = (seq_len - 2 * kv) // 2
    i = np.arange(1, slots + 1, dtype=np.float64)
    p = 0.01 * i ** (0.01 - 1)
    p /= p.sum()  # the first slot drawn (the first key's) has exactly the power-law distribution
    freq = torch.bincount(gap_index, minlength=slots + 1)[1:].double().numpy() / n
    for k in (0, 1, 2, 10):
        sigma = np.sqrt(p[k] * (1 - p[k]) / n)
        assert abs(freq[k] - p[k]) < 5 * sigma, (k, freq[k], p[k])
    assert abs(gap_index.double().mean().item() - (i * p).sum()) < 5 * np.sqrt((i**2 * p).sum() / n)
    np.testing.assert_allclose(gap_probabilities(slots, 0.01), p)
    # a = 1 is uniform: the first slot is no more likely than any other
    inputs, labels = generate(n, seq_len, kv, power_a=1.0, seed=0)
    rows, cols = torch.nonzero(labels != -100, as_tuple=True)
    first = cols[inputs[rows, cols] == inputs[rows, 0]]
    assert abs((first == 2 * kv).double().mean().item() - 1 / slots) < 5 * np.sqrt(1 / slots / n)


def test_reproducible_from_the_seed_alone():
    a = generate(50, 64, 8, seed=11)
    b = generate(50, 64, 8, seed=11)
    c = generate(50, 64, 8, seed=12)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    torch.manual_seed(123)
    np.random.seed(123)
    d = generate(50, 64, 8, seed=11)  # global torch / numpy RNG state plays no part
    assert torch.equal(a[0], d[0])


@pytest.mark.parametrize("kwargs, match", [
    ({"seq_len": 63}, "even"),
    ({"seq_len": 64, "num_kv_pairs": 17}, "4 \\* num_kv_pairs"),
    ({"vocab_size": 16, "num_kv_pairs": 8}, "vocab_size"),
    ({"power_a": 0.0}, "power_a"),
    ({"num_examples": 0}, "num_examples"),
    ({"num_kv_pairs": 0}, "num_kv_pairs"),
])
def test_bad_arguments(kwargs, match):
    args = {"num_examples": 4, "seq_len": 64, "num_kv_pairs": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(**args)


def test_model_labels_move_values_one_position_right():
    _, labels = generate(5, 32, 4, seed=0)
    shifted = model_labels(labels)
    assert (shifted[:, 0] == -100).all()
    rows, cols = torch.nonzero(labels != -100, as_tuple=True)
    assert torch.equal(shifted[rows, cols + 1], labels[rows, cols])
    assert int((shifted != -100).sum()) == int((labels != -100).sum())


CFG = {"type": "mqar", "vocab_size": 512, "power_a": 0.01, "train_seed": None,
       "train": [{"seq_len": 32, "num_kv_pairs": 4, "num_examples": 40},
                 {"seq_len": 16, "num_kv_pairs": 2, "num_examples": 26}],
       "test_seed": 5, "test": [{"seq_len": 32, "num_kv_pairs": 8, "num_examples": 6}]}


def take(loader, n):
    return [next(loader) for _ in range(n)]


def test_loader_batches_are_the_generated_examples_each_once_per_epoch():
    loader = build_train_loader(CFG, None, seq_len=32, batch_size=4, seed=7)
    assert isinstance(loader, MQARLoader)
    per_epoch = 40 // 4 + 26 // 4
    assert loader.stats["batches_per_epoch"] == per_epoch
    seen = {32: set(), 16: set()}
    for batch in take(loader, per_epoch):
        x, y = batch["input_ids"], batch["labels"]
        t = x.shape[1]
        assert x.shape == (4, t) and t in seen
        check_examples(x, y.roll(-1, dims=1), t, 4 if t == 32 else 2, 512)  # labels are model_labels
        assert (y[:, 0] == -100).all()
        seen[t].update(tuple(row) for row in x.tolist())
    assert len(seen[32]) == 40 and len(seen[16]) == 24  # every example once (26 % 4 left out of the epoch)
    assert loader.stats["epochs_completed"] == 0
    next(loader)
    assert loader.stats["epochs_completed"] == 1 and loader.stats["tokens"] > 0 and loader.stats["malformed"] == 0


def test_loader_resume_is_exact():
    kw = {"seq_len": 32, "batch_size": 4, "seed": 3}
    reference = take(build_train_loader(CFG, None, **kw), 40)  # more than two epochs
    for k in (1, 16, 23):
        first = build_train_loader(CFG, None, **kw)
        take(first, k)
        sd = json.loads(json.dumps(first.state_dict()))
        buf = io.BytesIO()
        torch.save(first.state_dict(), buf)
        second = build_train_loader(CFG, None, **kw)
        second.load_state_dict(sd)
        assert second.stats == first.stats
        for a, b in zip(take(second, 40 - k), reference[k:]):
            assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def test_loader_shards_rows_of_the_same_global_batch():
    whole = take(build_train_loader(CFG, None, seq_len=32, batch_size=4, seed=1), 12)
    parts = [take(build_train_loader(CFG, None, seq_len=32, batch_size=2, rank=r, world_size=2, seed=1), 12)
             for r in range(2)]
    for g, a, b in zip(whole, *parts):
        assert torch.equal(torch.cat([a["input_ids"], b["input_ids"]]), g["input_ids"])
        assert torch.equal(torch.cat([a["labels"], b["labels"]]), g["labels"])
    other_rank = build_train_loader(CFG, None, seq_len=32, batch_size=2, rank=1, world_size=2, seed=1)
    with pytest.raises(ValueError, match="rank"):
        other_rank.load_state_dict(build_train_loader(CFG, None, seq_len=32, batch_size=2, rank=0, world_size=2,
                                                      seed=1).state_dict())


def test_training_seed_and_test_sets():
    a = next(build_train_loader(CFG, None, seq_len=32, batch_size=4, seed=1))
    b = next(build_train_loader(CFG, None, seq_len=32, batch_size=4, seed=2))
    fixed = {**CFG, "train_seed": 9}
    c = next(build_train_loader(fixed, None, seq_len=32, batch_size=4, seed=1))
    d = next(build_train_loader(fixed, None, seq_len=32, batch_size=4, seed=1))
    assert not torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(c["input_ids"], d["input_ids"])
    tests = build_test_sets(CFG)
    again = build_test_sets({**CFG, "train_seed": 4})
    assert [t["name"] for t in tests] == ["T32_kv8"]
    assert torch.equal(tests[0]["inputs"], again[0]["inputs"])  # test sets depend on test_seed alone
    check_examples(tests[0]["inputs"], tests[0]["labels"], 32, 8, 512)
    assert not torch.equal(build_test_sets({**CFG, "test_seed": 6})[0]["inputs"], tests[0]["inputs"])


def test_loader_config_errors():
    with pytest.raises(ValueError, match="fewer examples than one global batch"):
        build_train_loader(CFG, None, seq_len=32, batch_size=32, seed=0)
    with pytest.raises(ValueError, match="lacks"):
        build_train_loader({**CFG, "train": [{"seq_len": 32, "num_kv_pairs": 4}]}, None, seq_len=32, batch_size=2)
    with pytest.raises(ValueError, match="no `train`"):
        build_train_loader({"type": "mqar"}, None, seq_len=32, batch_size=2)
