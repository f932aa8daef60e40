"""Multi-query associative recall (MQAR, the Zoology protocol): the generator and the train.py source.

One example of length T with n key-value pairs (vocab V, split S = V // 2)::

    position   0   1   2   3  ...  2n-2 2n-1 | 2n ...                                    T-1
    inputs     k1  v1  k2  v2 ...  kn   vn   | filler, and each key k_j once at an even slot q_j
    labels     -100 everywhere, except labels[q_j] = v_j

- keys: n distinct tokens from [1, S); values: n distinct tokens from [S, V); both in random order.
- queries: the even slots after the key-value block are 2n + 2(i - 1) for gap index i = 1 .. (T - 2n) / 2. The n
  query slots are drawn without replacement with probability proportional to a * i^(a - 1) (a = power_a; the
  power law favours slots right after the block); the j-th slot drawn asks for the j-th key of the block. The
  last slot is T - 2, so every query is followed by one more position (see the label convention).
- filler: every position that is neither in the block nor a query holds a token drawn uniformly from [0, V)
  (Zoology's random non-query tokens). Fillers are never labelled; a filler may equal a key by chance.

Label convention. ``generate`` returns labels *at the query position*: ``labels[q] = v`` means "the logits
computed at position q, having just read the key, must predict v" (Zoology's already-shifted convention), and
eval_suites.mqar scores argmax(logits[q]) against labels[q]. hilo models shift labels themselves (the HF
convention: logits at t are scored against labels[t + 1]), so the training source hands the model
``model_labels(labels)``, the same labels moved one position to the right (value at q + 1), which makes the
model's loss exactly the cross-entropy of the logits at each query position against its value.

Reproducibility: everything comes from one numpy Generator seeded with ``seed``; torch only builds the tensors.

The train.py source (``data=mqar``, conf/data/mqar.yaml) is ``MQARLoader``: fixed training sets per
(seq_len, num_kv_pairs) setting, batches of one setting at a time, fixed test sets from a separate seed.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

IGNORE_INDEX = -100
STATE_VERSION = 1


def _check(num_examples: int, seq_len: int, num_kv_pairs: int, vocab_size: int, power_a: float) -> None:
    for name, value in (("num_examples", num_examples), ("seq_len", seq_len), ("num_kv_pairs", num_kv_pairs),
                        ("vocab_size", vocab_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"MQAR {name} must be a positive integer, got {value!r}")
    if seq_len % 2:
        raise ValueError(f"MQAR seq_len must be even (key-value pairs and queries sit on even slots), got {seq_len}")
    if 4 * num_kv_pairs > seq_len:
        raise ValueError(f"MQAR needs 4 * num_kv_pairs <= seq_len (the block takes 2n positions and the n queries "
                         f"n even slots after it), got num_kv_pairs={num_kv_pairs}, seq_len={seq_len}")
    if num_kv_pairs > vocab_size // 2 - 1:
        raise ValueError(f"MQAR draws {num_kv_pairs} distinct keys from [1, {vocab_size // 2}): vocab_size="
                         f"{vocab_size} is too small (needs vocab_size >= 2 * (num_kv_pairs + 1))")
    if isinstance(power_a, bool) or not isinstance(power_a, (int, float)) or not power_a > 0:
        raise ValueError(f"MQAR power_a must be a positive number (query gaps drawn with p(i) ~ a * i^(a - 1)), "
                         f"got {power_a!r}")


def gap_probabilities(num_slots: int, power_a: float) -> np.ndarray:
    """p(i) proportional to power_a * i^(power_a - 1) over gap indices i = 1 .. num_slots (sums to 1)."""
    i = np.arange(1, num_slots + 1, dtype=np.float64)
    p = power_a * i ** (power_a - 1)
    return p / p.sum()


def generate(num_examples: int, seq_len: int, num_kv_pairs: int, vocab_size: int = 8192, power_a: float = 0.01,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """MQAR examples: (inputs, labels), LongTensors [num_examples, seq_len]; see the module docstring.

    labels hold the paired value at each query position (the key's position) and -100 elsewhere. Raises
    ValueError for an odd seq_len, 4 * num_kv_pairs > seq_len, a vocabulary too small for distinct keys, or
    power_a <= 0.
    """
    _check(num_examples, seq_len, num_kv_pairs, vocab_size, power_a)
    rng = np.random.Generator(np.random.PCG64(seed))
    n, t, split = num_examples, seq_len, vocab_size // 2
    keys = np.stack([rng.choice(split - 1, size=num_kv_pairs, replace=False) + 1 for _ in range(n)])
    values = np.stack([rng.choice(vocab_size - split, size=num_kv_pairs, replace=False) + split for _ in range(n)])
    inputs = rng.integers(0, vocab_size, size=(n, t))
    block = 2 * num_kv_pairs
    inputs[:, 0:block:2] = keys
    inputs[:, 1:block:2] = values
    # Weighted sampling without replacement as Gumbel top-k: sorting log p + Gumbel noise in decreasing order gives
    # the slots in the order successive weighted draws would pick them.
    num_slots = (t - block) // 2
    scores = np.log(gap_probabilities(num_slots, power_a)) + rng.gumbel(size=(n, num_slots))
    drawn = np.argsort(-scores, axis=1, kind="stable")[:, :num_kv_pairs]  # gap index - 1, in draw order
    query_pos = block + 2 * drawn
    rows = np.arange(n)[:, None]
    inputs[rows, query_pos] = keys
    labels = np.full((n, t), IGNORE_INDEX, dtype=np.int64)
    labels[rows, query_pos] = values
    return torch.from_numpy(inputs.astype(np.int64)), torch.from_numpy(labels)


def model_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels for a model that shifts them (hilo, HF): labels moved one position right, -100 at position 0, so the
    loss scores the logits at each query position against its value."""
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:, 1:] = labels[:, :-1]
    return out


def derived_seed(seed: int, stream: int, index: int) -> int:
    """An independent integer seed for set ``index`` of ``stream`` (0: training sets, 1: test sets)."""
    return int(np.random.SeedSequence([int(seed), stream, index]).generate_state(1, dtype=np.uint64)[0])


def _settings(cfg: Mapping, key: str) -> list[dict]:
    items = cfg.get(key)
    if not items:
        raise ValueError(f"MQAR data config has no `{key}`: give a list of {{seq_len, num_kv_pairs, num_examples}}")
    out = []
    for item in items:
        missing = {"seq_len", "num_kv_pairs", "num_examples"} - set(item)
        if missing:
            raise ValueError(f"MQAR data.{key} entry {dict(item)} lacks {sorted(missing)}")
        out.append({k: int(item[k]) for k in ("seq_len", "num_kv_pairs", "num_examples")})
    return out


def slice_name(seq_len: int, num_kv_pairs: int) -> str:
    """The name of a (seq_len, num_kv_pairs) slice in metrics: T256_kv16."""
    return f"T{seq_len}_kv{num_kv_pairs}"


def build_test_sets(data_cfg: Mapping) -> list[dict]:
    """The fixed MQAR test sets of a data config: one dict per data.test entry with seq_len, num_kv_pairs, name,
    inputs and labels (the generator's labels, at the query positions). Seeded by data.test_seed alone, so every
    run of a sweep is scored on the same examples."""
    vocab, power_a = int(data_cfg.get("vocab_size", 8192)), float(data_cfg.get("power_a", 0.01))
    seed = int(data_cfg.get("test_seed", 1))
    out = []
    for j, s in enumerate(_settings(data_cfg, "test")):
        inputs, labels = generate(s["num_examples"], s["seq_len"], s["num_kv_pairs"], vocab, power_a,
                                  seed=derived_seed(seed, 1, j))
        out.append({"seq_len": s["seq_len"], "num_kv_pairs": s["num_kv_pairs"],
                    "name": slice_name(s["seq_len"], s["num_kv_pairs"]), "inputs": inputs, "labels": labels})
    return out


class MQARLoader:
    """Endless, resumable iterator of MQAR training batches for one rank: {"input_ids", "labels"} [batch_size, T].

    Training sets: data.train is a list of settings {seq_len, num_kv_pairs, num_examples}; setting i holds
    num_examples fixed examples generated with derived_seed(seed, 0, i) (seed: data.train_seed, or the run's seed
    when null). An epoch shuffles every setting's examples, cuts them into global batches of batch_size *
    world_size rows of one setting (a remainder smaller than a global batch is left out of that epoch) and
    shuffles the order of all those batches, from a Generator seeded with (seed, epoch). Rank r keeps rows
    [r * batch_size, (r + 1) * batch_size) of each global batch, so the global batches do not depend on the number
    of processes. "labels" are model_labels (value one position after the query; the model shifts them back).

    The position is (epoch, batch index), so state_dict()/load_state_dict() resume exactly. No tokenizer is used:
    the vocabulary is data.vocab_size.
    """

    def __init__(self, data_cfg: Mapping, *, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0):
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad batch_size={batch_size}, rank={rank}, world_size={world_size}")
        self.vocab_size = int(data_cfg.get("vocab_size", 8192))
        self.power_a = float(data_cfg.get("power_a", 0.01))
        train_seed = data_cfg.get("train_seed")
        self.seed = int(seed if train_seed is None else train_seed)
        self.settings = _settings(data_cfg, "train")
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        global_batch = batch_size * world_size
        small = [s for s in self.settings if s["num_examples"] < global_batch]
        if small:
            raise ValueError(f"MQAR training settings {small} have fewer examples than one global batch "
                             f"({batch_size} rows x {world_size} processes)")
        self.sets = []
        for i, s in enumerate(self.settings):
            inputs, labels = generate(s["num_examples"], s["seq_len"], s["num_kv_pairs"], self.vocab_size,
                                      self.power_a, seed=derived_seed(self.seed, 0, i))
            self.sets.append((inputs, model_labels(labels)))
        self.epoch, self.index = 0, 0
        self.counters = {"batches": 0, "tokens": 0, "epochs_completed": 0}
        self._plan = self._epoch_plan(0)

    def _epoch_plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """The epoch's global batches: (setting, example indices [batch_size * world_size])."""
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 2, epoch])))
        global_batch = self.batch_size * self.world_size
        plan = []
        for i, s in enumerate(self.settings):
            order = rng.permutation(s["num_examples"])
            plan.extend((i, order[b:b + global_batch]) for b in range(0, len(order) - global_batch + 1, global_batch))
        return [plan[k] for k in rng.permutation(len(plan))]

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.index == len(self._plan):
            self.epoch, self.index = self.epoch + 1, 0
            self.counters["epochs_completed"] += 1
            self._plan = self._epoch_plan(self.epoch)
        setting, rows = self._plan[self.index]
        self.index += 1
        mine = torch.from_numpy(rows[self.rank * self.batch_size:(self.rank + 1) * self.batch_size])
        inputs, labels = self.sets[setting]
        batch = {"input_ids": inputs[mine], "labels": labels[mine]}
        self.counters["batches"] += 1
        self.counters["tokens"] += batch["input_ids"].numel()
        return batch

    @property
    def stats(self) -> dict:
        """Counters: batches and tokens emitted by this rank, epochs completed, the epoch's position, the number of
        training examples; malformed is always 0 (generated data)."""
        return {**self.counters, "epoch": self.epoch, "batch_in_epoch": self.index,
                "batches_per_epoch": len(self._plan), "examples": sum(s["num_examples"] for s in self.settings),
                "malformed": 0}

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "type": "mqar", "rank": self.rank, "world_size": self.world_size,
                "seed": self.seed, "settings": [dict(s) for s in self.settings], "epoch": self.epoch,
                "index": self.index, "counters": dict(self.counters)}

    def load_state_dict(self, sd: Mapping) -> None:
        if sd.get("version") != STATE_VERSION or sd.get("type") != "mqar":
            raise ValueError(f"not an MQAR loader state (version {sd.get('version')}, type {sd.get('type')})")
        if (sd["rank"], sd["world_size"]) != (self.rank, self.world_size):
            raise ValueError(f"loader state of rank {sd['rank']}/{sd['world_size']} given to rank "
                             f"{self.rank}/{self.world_size}: resume with the same world size")
        if sd["seed"] != self.seed or [dict(s) for s in sd["settings"]] != self.settings:
            raise ValueError("MQAR loader state was saved with other training sets (data.train / seed changed)")
        self.epoch, self.index = int(sd["epoch"]), int(sd["index"])
        self._plan = self._epoch_plan(self.epoch)
        self.counters = dict(sd["counters"])
