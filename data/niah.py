"""Needle-in-a-haystack documents in RULER's NIAH format: task definitions, needles, haystacks, prompts and length
fitting in model tokens. Shared by the RULER suite (eval_suites/ruler: evaluation samples) and the training
retrieval mix (data/retrieval_mix.py: training documents), so both build the very same prompt format.

A needle is the sentence ``One of the special magic {type_needle_v} for {key} is: {value}.`` (the plural type
name always: "numbers", "uuids", "words"). A document hides ``num_keys x num_values`` needles in a haystack,
asks for the values of ``num_queries`` of the keys, and its reference answers are those values:

    {template}{answer_prefix}   with {context} = the haystack with the needles inserted

Haystacks: ``noise`` (RULER's five sentences, one copy a line), ``needle`` (lines of distractor needles with fresh
random keys and values of the task's types), ``essay`` (the first n words of a long text, whitespace collapsed,
split into sentences; the needles go between sentences, joined by spaces; the text is repeated when n exceeds
it). Needle depths are drawn without replacement from 40 evenly spaced depths in [0, 100] % and inserted in sorted
order: a needle at depth d goes before haystack unit ``int(n * d / 100)`` of the n units (lines, or sentences for
the essay).

Lengths are counted in model tokens: a prompt is ``[eos] + tokenizer.encode(text)`` (EOS opens a document, as in
hilo's packed training stream), and ``fit_haystack`` finds the largest haystack size n whose prompt fits a budget.
Everything random comes from one ``random.Random`` handed to ``NeedleBuilder``: callers choose its seed (RULER's
samples and the training documents draw theirs from separate namespaces).
"""
from __future__ import annotations

import random
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
WORDS_FILE = Path(__file__).resolve().parent / "niah_words.txt"

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


class NeedleBuilder:
    """The parts of one document that do not depend on the haystack size (needles, depths, queries, answers, all
    drawn from ``rng``), and ``render(n)`` for a given size. essay_words: the essay haystack's words (essay
    tasks only)."""

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


def _interpolated_fitting(count: Callable[[int], int], budget: int, upper: int) -> int:
    """What _largest_fitting returns, in fewer evaluations when count grows about linearly in n (a haystack's
    tokens): each guess interpolates the budget between the bracket's ends (extrapolates from the lower end
    while no upper one is measured), about six evaluations, then bisection if guesses stop closing the bracket.
    Its guesses depend on nothing but count, so the result is a function of the document alone."""
    lo, hi, c0 = 0, upper, count(0)  # count(lo) <= budget < count(hi)
    c_lo, c_hi = c0, None
    n = min(32, upper - 1)  # a short haystack measures the tokens per unit
    for step in range(64):
        if hi - lo <= 1:
            break
        n = (lo + hi) // 2 if step >= 8 else min(max(n, lo + 1), hi - 1)
        c = count(n)
        if c <= budget:
            lo, c_lo = n, c
        else:
            hi, c_hi = n, c
        if c_hi is None:  # lo > 0 here: the first guess fitted
            n = lo + (budget - c_lo) * lo // max(c_lo - c0, 1)
        else:
            n = lo + (budget - c_lo) * (hi - lo) // max(c_hi - c_lo, 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) <= budget else (lo, mid)
    return lo


class PromptTooLong(ValueError):
    """Not even the prompt without any haystack fits the budget (``tokens`` > ``budget``)."""

    def __init__(self, message: str, tokens: int, budget: int):
        super().__init__(message)
        self.tokens, self.budget = tokens, budget


def fit_haystack(builder: NeedleBuilder, tokenizer, *, budget: int, hint: int | None = None,
                 what: str = "the budget", interpolate: bool = False) -> int:
    """The largest haystack size n with ``1 + len(tokenizer.encode(builder.render(n))) <= budget`` (the prompt
    after its opening EOS). hint: a size to start the search from (e.g. the previous document's); it changes only
    the speed, never the result. interpolate: search by the tokens per haystack unit instead (fewer encodes;
    hint unused). Raises PromptTooLong (naming ``what`` the budget is) when not even n = 0 fits."""
    counts: dict[int, int] = {}

    def count(n: int) -> int:
        if n not in counts:
            counts[n] = 1 + len(tokenizer.encode(builder.render(n)))
        return counts[n]

    if count(0) > budget:
        raise PromptTooLong(f"{builder.task.name}: the prompt without any haystack already has {count(0)} tokens, "
                            f"over {what} = {budget}", count(0), budget)
    # Every haystack unit (a line, or an essay word after a space) adds at least one token.
    if interpolate:
        return _interpolated_fitting(count, budget, budget + 1)
    return _largest_fitting(count, budget, budget + 1, hint)


@dataclass
class NeedleDocument:
    """A training document: ``input_ids`` = [eos] + encode(prompt) + encode(answer) + [eos]. ``prompt`` is the
    text an evaluation sample shows the model (template, haystack with the needles, question, answer prefix);
    ``answer`` is the reference answers after it (" v." or " v1, v2, and v3."). ``needles`` are (key, value,
    depth %) in the order they appear."""

    task: str
    input_ids: list[int]
    prompt: str
    answer: str
    answers: list[str]
    queries: list[str]
    needles: list[tuple[str, str, int]]
    num_haystack: int


def answer_text(answers: Sequence[str]) -> str:
    """The continuation after a prompt's answer prefix: ' v.' or ' v1, v2, and v3.' (what string_match_all
    scores is every reference appearing in it)."""
    return " " + query_text(answers) + "."


def make_document(task: str | NiahTask, *, length: int, tokenizer, rng: random.Random,
                  essay_words: Sequence[str] | None = None,
                  words: tuple[tuple[str, ...], tuple[str, ...]] | None = None) -> NeedleDocument:
    """A needle document of at most ``length`` tokens, answer included: the largest haystack for which
    ``[eos] + encode(prompt) + encode(answer) + [eos]`` fits. The prompt tokens are those an evaluation sample of
    the same needles would have (the answer is encoded on its own, after them). rng: the source of every random
    choice. essay_words: the essay haystack (essay tasks). words: (adjectives, nouns), default niah_words.txt.
    The haystack size is searched by interpolation (fit_haystack), from nothing but the document itself, so the
    same rng and words always give the same document. Raises PromptTooLong when not even an empty haystack
    fits."""
    task = get_task(task) if isinstance(task, str) else task
    if task.haystack == "essay" and not essay_words:
        raise ValueError(f"task {task.name} needs essay words for its haystack")
    builder = NeedleBuilder(task, rng, words or load_words(), essay_words)
    answer = answer_text(builder.answers)
    answer_ids = list(tokenizer.encode(answer))
    budget = length - len(answer_ids) - 1
    n = fit_haystack(builder, tokenizer, budget=budget, interpolate=True,
                     what=f"length {length} - {len(answer_ids) + 1} answer and EOS tokens")
    prompt = builder.render(n)
    eos = int(tokenizer.eos_id)
    return NeedleDocument(task=task.name, input_ids=[eos, *tokenizer.encode(prompt), *answer_ids, eos],
                          prompt=prompt, answer=answer, answers=list(builder.answers), queries=list(builder.queries),
                          needles=list(builder.needles), num_haystack=n)
