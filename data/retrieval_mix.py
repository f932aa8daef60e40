"""The retrieval mix (``data.retrieval_mix``): training rows replaced by synthetic needle-in-a-haystack documents.

Small models trained briefly on plain text never learn RULER's task format, so its needles score 0 for every
architecture and cannot tell them apart. Small-scale long-context studies therefore mix synthetic retrieval
documents into pretraining; this module does that with RULER's own format (data/niah.py)::

    retrieval_mix:
      fraction: 0.25                          # probability that a training row is a needle document; 0: off
      tasks: [niah_single_1, niah_single_2]   # drawn uniformly per needle row

Each packed row of ``seq_len`` tokens is, with probability ``fraction``, replaced by one needle document: ``[eos]
+ prompt + answer + [eos]`` (data.niah.make_document: the template, a haystack with the needles at random depths,
the question, the answer prefix, then the reference answers), with the largest haystack that fits in seq_len,
followed by EOS padding up to exactly seq_len whose labels are ignored (-100; fewer tokens than one haystack
unit). The loss is the ordinary LM loss over the document, prompt included: the model learns the haystack text,
the needle format and the answer after the question, and its final EOS (so a greedy RULER answer stops there).

Haystacks: ``essay`` tasks take theirs from the replaced row's own text (its tokens decoded, split into words,
repeated when they fall short), so the needles sit in training-stream text and the held-out split (RULER's
evaluation haystack and the validation data) is never trained on; ``noise`` and ``needle`` tasks build theirs from
RULER's noise sentences and distractor needles. The replaced row is taken from the token buffer as a plain row
would be, so every other row is exactly the row of the unmixed run.

Determinism: whether row i (counted by the loader, in its checkpointed state) is replaced, which task it gets and
every needle, key, value and depth come from ``random.Random(row_seed(seed, rank, i))``, a hash of
(``train-niah``, seed, rank, i), plus the row's text for essay haystacks: a resumed loader rebuilds the same rows,
and ranks (which read different shards) get different needles. With ``data.shard=rows`` the global loader counts
global rows (rank 0 of 1), so the rows do not depend on the number of processes. RULER's evaluation samples seed
theirs from ``ruler/{seed}/{task}/{length}/{index}`` (eval_suites.ruler.sample_seed): another namespace, so no
training document repeats an evaluation sample's needles.

Validation: ``heldout_needle_documents`` builds the documents a run with the mix on scores each validation
(training.validation.evaluate_needles: val/needle_acc), seeded from ``val-niah/{seed}/{i}``, a third namespace.

Varlen packing works as fixed does: the document and its padding are separate segments (the document attends to
nothing else, its positions start at 0, as an evaluation prompt's do).
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence

from .niah import (
    NOISE,
    TASK_NAMES,
    NeedleBuilder,
    NeedleDocument,
    PromptTooLong,
    answer_text,
    get_task,
    load_words,
    make_document,
)
from .packing import Piece

FIELDS = ("fraction", "tasks")
SEED_NAMESPACE = "train-niah"
HELDOUT_NAMESPACE = "val-niah"
# Needle documents with no haystack vary in length with their random keys and values (word pieces, uuids): the
# seq_len check measures this many of each task and asks for this much room beyond the longest.
_PROBES, _MARGIN = 16, 16


def _hashed_seed(*parts) -> int:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def row_seed(seed: int, rank: int, row: int) -> int:
    """The seed of training row ``row`` of ``rank``: a hash of (train-niah, seed, rank, row), never one of RULER's
    sample seeds' inputs (those start with ``ruler/``)."""
    return _hashed_seed(SEED_NAMESPACE, seed, rank, row)


def heldout_needle_documents(cfg: Mapping, tokenizer, *, seq_len: int, seed: int, num: int,
                             essay_words: Sequence[str]) -> list[NeedleDocument]:
    """The needle documents a run with the mix on validates its retrieval on (training.validation.needle_set):
    ``num`` documents of at most seq_len tokens, of the mix's tasks in turn, document i seeded from a hash of
    (val-niah, seed, i), a namespace that neither the training rows nor RULER's samples use. Their essay haystacks
    are ``essay_words``: the held-out split's text, never trained on, as RULER's haystack is."""
    tasks = [get_task(name) for name in _tasks(cfg.get("tasks"))]
    docs = []
    for i in range(num):
        task = tasks[i % len(tasks)]
        docs.append(make_document(task, length=seq_len, tokenizer=tokenizer,
                                  rng=random.Random(_hashed_seed(HELDOUT_NAMESPACE, seed, i)),
                                  essay_words=essay_words if task.haystack == "essay" else None))
    return docs


def _fraction(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"data.retrieval_mix.fraction={value!r}: expected a number in [0, 1] (the probability that "
                         f"a training row is a needle document; 0 turns the mix off)")
    return float(value)


def _tasks(value) -> list[str]:
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"data.retrieval_mix.tasks={value!r}: expected a non-empty list of RULER NIAH task names "
                         f"from {', '.join(TASK_NAMES)}")
    for name in value:
        if name not in TASK_NAMES:
            raise ValueError(f"data.retrieval_mix.tasks: unknown task {name!r}; choose from {', '.join(TASK_NAMES)}")
    return list(value)


def min_seq_len(task: str, tokenizer) -> int:
    """The seq_len the mix asks for a task: its longest needle document with an empty haystack among a few
    probes, plus a margin for longer random keys and values."""
    longest = 0
    words = load_words()
    for probe in range(_PROBES):
        builder = NeedleBuilder(get_task(task), random.Random(probe), words, NOISE.split())
        tokens = 2 + len(tokenizer.encode(builder.render(0))) + len(tokenizer.encode(answer_text(builder.answers)))
        longest = max(longest, tokens)
    return longest + _MARGIN


class RetrievalMix:
    """Decides, per training row, whether it becomes a needle document, and builds that document; stateless (the
    loader's row count is the only state it reads)."""

    def __init__(self, cfg: Mapping, tokenizer, *, seq_len: int, seed: int, rank: int):
        self.fraction, self.tasks = _fraction(cfg.get("fraction", 0.0)), _tasks(cfg.get("tasks"))
        self.tokenizer, self.eos_id = tokenizer, int(tokenizer.eos_id)
        self.seq_len, self.seed, self.rank = seq_len, seed, rank
        for task in self.tasks:
            need = min_seq_len(task, tokenizer)
            if seq_len < need:
                raise ValueError(f"data.retrieval_mix: a {task} needle document needs seq_len >= {need} tokens "
                                 f"(about its prompt with no haystack), trainer.seq_len is {seq_len}: raise "
                                 f"trainer.seq_len, drop {task} from data.retrieval_mix.tasks, or set "
                                 f"data.retrieval_mix.fraction=0")

    def _row_words(self, pieces: list[Piece]) -> list[str]:
        """The words of a row's text: its documents (split at EOS) decoded, whitespace collapsed."""
        segments, current = [], []
        for tokens, _ in pieces:
            for token in tokens:
                if token == self.eos_id:
                    segments.append(current)
                    current = []
                else:
                    current.append(token)
        segments.append(current)
        words = " ".join(self.tokenizer.decode(s) for s in segments if s).split()
        return words or NOISE.split()  # a row of EOS alone: RULER's noise sentences stand in for text

    def replace(self, row: int, pieces: list[Piece]) -> tuple[list[Piece], int] | None:
        """Row ``row`` (the loader's count) whose plain content is ``pieces``: None when it stays as it is, else the
        needle row's pieces (the document, then its EOS padding) and the document's length in tokens."""
        rng = random.Random(row_seed(self.seed, self.rank, row))
        if rng.random() >= self.fraction:
            return None
        task = get_task(self.tasks[rng.randrange(len(self.tasks))])
        essay = self._row_words(pieces) if task.haystack == "essay" else None
        try:
            doc = make_document(task, length=self.seq_len, tokenizer=self.tokenizer, rng=rng, essay_words=essay)
        except PromptTooLong as e:
            raise ValueError(f"data.retrieval_mix: row {row}'s {task.name} needle document needs {e.tokens} tokens "
                             f"with no haystack, over trainer.seq_len={self.seq_len}: raise trainer.seq_len or "
                             f"drop {task.name} from data.retrieval_mix.tasks") from None
        pad = self.seq_len - len(doc.input_ids)
        return [(doc.input_ids, True)] + ([([self.eos_id] * pad, True)] if pad else []), len(doc.input_ids)


def build_retrieval_mix(cfg, tokenizer, *, seq_len: int, seed: int, rank: int) -> RetrievalMix | None:
    """The mix of ``data.retrieval_mix`` (None, absent or fraction 0: None, no row is replaced). Every field is
    checked even when the mix is off; the seq_len check only when it is on."""
    if cfg is None:
        return None
    if not isinstance(cfg, Mapping):
        raise ValueError(  # noqa: TRY004 (a config error, as every other data.* one)
            f"data.retrieval_mix={cfg!r}: expected a mapping {{fraction: 0..1, tasks: [...]}}")
    unknown = sorted(set(cfg) - set(FIELDS))
    if unknown:
        raise ValueError(f"data.retrieval_mix: unknown key(s) {', '.join(map(str, unknown))}; valid: "
                         f"{', '.join(FIELDS)}")
    if _fraction(cfg.get("fraction", 0.0)) == 0:
        if cfg.get("tasks") is not None:
            _tasks(cfg["tasks"])
        return None
    return RetrievalMix(cfg, tokenizer, seq_len=seq_len, seed=seed, rank=rank)
