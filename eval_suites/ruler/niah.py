"""RULER's needle-in-a-haystack tasks: task definitions, haystacks, prompts, and length fitting in model tokens.

A needle is the sentence ``One of the special magic {type_needle_v} for {key} is: {value}.`` (the plural type
name always: "numbers", "uuids", "words"). A sample hides ``num_keys x num_values`` needles in a haystack,
asks for the values of ``num_queries`` of the keys, and its reference answers are those values:

    {template}{answer_prefix}   with {context} = the haystack with the needles inserted

Haystacks: ``noise`` (RULER's five sentences, one copy a line), ``needle`` (lines of distractor needles with fresh
random keys and values of the task's types), ``essay`` (the first n words of a long-text corpus, whitespace
collapsed, split into sentences; the needles go between sentences, joined by spaces). Needle depths are drawn
without replacement from 40 evenly spaced depths in [0, 100] % and inserted in sorted order: a needle at depth
d goes before haystack unit ``int(n * d / 100)`` of the n units (lines, or sentences for the essay).

Lengths are counted in model tokens: the prompt is ``[eos] + tokenizer.encode(text)`` (EOS opens a document, as
in hilo's packed training stream), and the haystack size n is the largest one for which
``len(prompt) + max_new_tokens <= length``.

Every sample is reproducible from (seed, task, length, index) alone (``sample_seed``).
"""
from __future__ import annotations

import hashlib
import random
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
            "{type_needle_v} for {query} mentioned in the provided text?")
ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
# 40 evenly spaced needle depths in percent, 0 and 100 included (no value of 100 * i / 39 ends in .5).
DEPTHS = tuple(round(100 * i / 39) for i in range(40))
DEFAULT_HAYSTACK = "data/corpus/heldout.jsonl.zst"
WORDS_FILE = Path(__file__).resolve().parent / "words.txt"

HAYSTACK_TYPES = ("noise", "needle", "essay")
NEEDLE_TYPES = ("words", "numbers", "uuids")


@dataclass(frozen=True)
class NiahTask:
    """One RULER NIAH configuration: haystack type, key and value types, and the needle counts."""

    name: str
    haystack: str
    key_type: str
    value_type: str
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1

    def __post_init__(self):
        if self.haystack not in HAYSTACK_TYPES:
            raise ValueError(f"task {self.name}: haystack {self.haystack!r} not in {HAYSTACK_TYPES}")
        for kind in (self.key_type, self.value_type):
            if kind not in NEEDLE_TYPES:
                raise ValueError(f"task {self.name}: needle type {kind!r} not in {NEEDLE_TYPES}")
        if not 1 <= self.num_queries <= self.num_keys:
            raise ValueError(f"task {self.name}: num_queries must be in [1, num_keys = {self.num_keys}]")

    @property
    def single_answer(self) -> bool:
        """One reference answer: the template is reworded in the singular."""
        return self.num_queries * self.num_values == 1


TASKS: dict[str, NiahTask] = {t.name: t for t in (
    NiahTask("niah_single_1", "noise", "words", "numbers"),
    NiahTask("niah_single_2", "essay", "words", "numbers"),
    NiahTask("niah_single_3", "essay", "words", "uuids"),
    NiahTask("niah_multikey_1", "essay", "words", "numbers", num_keys=4),
    NiahTask("niah_multikey_2", "needle", "words", "numbers"),
    NiahTask("niah_multikey_3", "needle", "uuids", "uuids"),
    NiahTask("niah_multivalue", "essay", "words", "numbers", num_values=4),
    NiahTask("niah_multiquery", "essay", "words", "numbers", num_keys=4, num_queries=4),
)}
TASK_NAMES = tuple(TASKS)


@dataclass
class Sample:
    """One prompt with its references. ``needles`` are (key, value, depth %) in the order they appear."""

    task: str
    length: int
    index: int
    seed: int
    prompt: str
    input_ids: list[int]
    answers: list[str]
    queries: list[str]
    needles: list[tuple[str, str, int]]
    num_haystack: int
    max_new_tokens: int
    extra: dict = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)


def get_task(name: str) -> NiahTask:
    if name not in TASKS:
        raise ValueError(f"unknown RULER task {name!r}; choose from {', '.join(TASK_NAMES)}")
    return TASKS[name]


@cache
def load_words(path: str | Path = WORDS_FILE) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(adjectives, nouns) of a word list file with ``[adjectives]`` and ``[nouns]`` sections."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
        elif current is None:
            raise ValueError(f"{path}: word {line!r} before any [section]")
        else:
            current.append(line)
    if not sections.get("adjectives") or not sections.get("nouns"):
        raise ValueError(f"{path}: needs non-empty [adjectives] and [nouns] sections")
    return tuple(sections["adjectives"]), tuple(sections["nouns"])


def load_haystack(paths: str | Sequence[str] | None = None, field: str = "text") -> list[str]:
    """The essay haystack: the words of every document of ``paths`` (jsonl, jsonl.zst, json, parquet or txt
    files or globs; a relative path that does not exist from the working directory is taken from the repository
    root; None = the embedded corpus's held-out split)
    in file order, documents joined and every run of whitespace collapsed to one space, as RULER does with
    Paul Graham's essays."""
    from data.sources import Malformed, expand_paths, iter_file_records

    patterns = [paths] if isinstance(paths, (str, Path)) else list(paths) if paths is not None else [DEFAULT_HAYSTACK]
    # A path that exists from the working directory means that file; others resolve against the repository root.
    patterns = [str(Path(p).expanduser().resolve()) if "://" not in str(p) and Path(p).expanduser().exists()
                else str(p) for p in patterns]
    texts = []
    for path in expand_paths(patterns):
        for item in iter_file_records(path, field):
            if isinstance(item, str) and item.strip():
                texts.append(item)
            elif isinstance(item, Malformed):
                raise ValueError(f"haystack file {path}: malformed record ({item.reason}); pass a corpus whose "
                                 f"records hold the text under {field!r}")
    words = " ".join(texts).split()
    if not words:
        raise ValueError(f"haystack {paths or DEFAULT_HAYSTACK!r} holds no text")
    return words


def sample_seed(seed: int, task: str, length: int, index: int) -> int:
    """The seed of one sample: a hash of (seed, task, length, index), the same in every process and run."""
    digest = hashlib.sha256(f"ruler/{seed}/{task}/{length}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def random_value(kind: str, rng: random.Random, words: tuple[tuple[str, ...], tuple[str, ...]]) -> str:
    """A random key or value: an adjective-noun pair, a 7-digit number, or a version-4 uuid."""
    if kind == "words":
        adjectives, nouns = words
        return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


def _distinct(kind: str, count: int, rng: random.Random, words, taken: set[str]) -> list[str]:
    out = []
    while len(out) < count:
        value = random_value(kind, rng, words)
        if value not in taken:
            taken.add(value)
            out.append(value)
    return out


def templates(task: NiahTask) -> tuple[str, str]:
    """(template, answer prefix) of a task, with RULER's singular rewording when it has one answer."""
    template, prefix = TEMPLATE, ANSWER_PREFIX
    if task.single_answer:
        template, prefix = (text.replace("Some", "A").replace("are all", "is").replace("are", "is")
                            for text in (template, prefix))
        template, prefix = (text.replace("{type_needle_v}", task.value_type[:-1]) for text in (template, prefix))
    else:
        template, prefix = (text.replace("{type_needle_v}", task.value_type) for text in (template, prefix))
    return template, prefix


def query_text(queries: Sequence[str]) -> str:
    """'k' or 'k1, k2, and k3'."""
    return queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]


def _split_sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?]) ", text) if s]


class _Builder:
    """The parts of one sample that do not depend on the haystack size, and ``render(n)`` for a given size."""

    def __init__(self, task: NiahTask, rng: random.Random, words, essay_words: Sequence[str] | None):
        self.task, self.words, self.essay_words = task, words, essay_words
        taken: set[str] = set()
        keys = _distinct(task.key_type, task.num_keys, rng, words, taken)
        values = {key: _distinct(task.value_type, task.num_values, rng, words, taken) for key in keys}
        needles = [(key, value) for key in keys for value in values[key]]
        rng.shuffle(needles)
        depths = sorted(rng.sample(DEPTHS, len(needles)))
        self.needles = [(key, value, depth) for (key, value), depth in zip(needles, depths)]
        self.queries = rng.sample(keys, task.num_queries)
        self.answers = [value for key in self.queries for value in values[key]]
        self.taken = taken
        # Distractor needles come from their own stream, so the first n are the same for every n.
        self.distractor_rng = random.Random(rng.getrandbits(64))
        self.distractors: list[str] = []
        template, prefix = templates(task)
        query = query_text(self.queries)
        self.head, self.tail = template.split("{context}")
        self.tail = self.tail.format(query=query) + prefix.format(query=query)

    def needle_text(self, key: str, value: str) -> str:
        return NEEDLE.format(type_needle_v=self.task.value_type, key=key, value=value)

    def _distractor_lines(self, n: int) -> list[str]:
        while len(self.distractors) < n:
            key = _distinct(self.task.key_type, 1, self.distractor_rng, self.words, self.taken)[0]
            value = _distinct(self.task.value_type, 1, self.distractor_rng, self.words, self.taken)[0]
            self.distractors.append(self.needle_text(key, value))
        return self.distractors[:n]

    def context(self, n: int) -> str:
        kind = self.task.haystack
        needles = [self.needle_text(key, value) for key, value, _ in self.needles]
        if kind == "essay":
            source = self.essay_words
            repeats = -(-n // len(source)) if n else 0
            text = " ".join((list(source) * repeats)[:n] if repeats > 1 else source[:n])
            units = _split_sentences(text)
        else:
            units = [NOISE] * n if kind == "noise" else list(self._distractor_lines(n))
        cuts = [int(len(units) * depth / 100) for _, _, depth in self.needles]
        pieces, start = [], 0
        for cut, needle in zip(cuts, needles):
            pieces.extend(units[start:cut])
            pieces.append(needle)
            start = cut
        pieces.extend(units[start:])
        return (" " if kind == "essay" else "\n").join(pieces)

    def render(self, n: int) -> str:
        return self.head + self.context(n) + self.tail


def _largest_fitting(count: Callable[[int], int], budget: int, upper: int, hint: int | None) -> int:
    """The largest n in [0, upper) with count(n) <= budget, for a count that grows with n (count(upper) >
    budget is assumed); galloping out from ``hint`` then bisecting."""
    lo, hi = 0, upper  # count(lo) <= budget < count(hi)
    if hint is not None and 0 < hint < upper:
        step = max(1, hint // 64)
        if count(hint) <= budget:
            lo = hint
            while lo + step < hi and count(lo + step) <= budget:
                lo, step = lo + step, step * 2
            hi = min(hi, lo + step)
        else:
            hi = hint
            while hi - step > lo and count(hi - step) > budget:
                hi, step = hi - step, step * 2
            lo = max(lo, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def make_sample(task: str | NiahTask, *, length: int, tokenizer, index: int = 0, seed: int = 42,
                essay_words: Sequence[str] | None = None, max_new_tokens: int = 128,
                words: tuple[tuple[str, ...], tuple[str, ...]] | None = None, hint: int | None = None) -> Sample:
    """Sample ``index`` of ``task`` at ``length`` model tokens: the largest haystack with
    ``prompt_tokens + max_new_tokens <= length``.

    tokenizer: hilo's tokenizer interface (``encode``, ``eos_id``). essay_words: the essay haystack's words
    (``load_haystack()``), needed by essay tasks only. words: (adjectives, nouns), default the shipped
    words.txt. hint: a haystack size to start the search from (e.g. the previous sample's); it changes only
    the speed, never the result. Raises ValueError when not even an empty haystack fits.
    """
    task = get_task(task) if isinstance(task, str) else task
    if task.haystack == "essay" and not essay_words:
        raise ValueError(f"task {task.name} needs the essay haystack: pass essay_words=load_haystack(...)")
    rng_seed = sample_seed(seed, task.name, length, index)
    builder = _Builder(task, random.Random(rng_seed), words or load_words(), essay_words)
    prefix = [int(tokenizer.eos_id)]
    budget = length - max_new_tokens
    counts: dict[int, int] = {}

    def count(n: int) -> int:
        if n not in counts:
            counts[n] = len(prefix) + len(tokenizer.encode(builder.render(n)))
        return counts[n]

    if count(0) > budget:
        raise ValueError(f"{task.name} at length {length}: the prompt without any haystack already has "
                         f"{count(0)} tokens, over length - max_new_tokens = {budget}")
    # Every haystack unit (a line, or an essay word after a space) adds at least one token.
    n = _largest_fitting(count, budget, budget + 1, hint)
    prompt = builder.render(n)
    return Sample(task=task.name, length=length, index=index, seed=rng_seed, prompt=prompt,
                  input_ids=prefix + list(tokenizer.encode(prompt)), answers=list(builder.answers),
                  queries=list(builder.queries), needles=list(builder.needles), num_haystack=n,
                  max_new_tokens=max_new_tokens)


def build_samples(task: str | NiahTask, *, length: int, tokenizer, num_samples: int, seed: int = 42,
                  essay_words: Sequence[str] | None = None, max_new_tokens: int = 128) -> list[Sample]:
    """Samples 0 .. num_samples - 1 of a task at one length (each one's haystack size searched from the
    previous one's)."""
    samples, hint = [], None
    for index in range(num_samples):
        sample = make_sample(task, length=length, tokenizer=tokenizer, index=index, seed=seed,
                             essay_words=essay_words, max_new_tokens=max_new_tokens, hint=hint)
        hint = sample.num_haystack
        samples.append(sample)
    return samples
