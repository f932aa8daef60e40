"""RULER's needle-in-a-haystack samples: reproducible evaluation prompts fitted to a length in model tokens.

The tasks, needles, haystacks, templates and length fitting are data/niah.py's (shared with the training
retrieval mix, data/retrieval_mix.py, so training documents and evaluation samples have one format); this module
adds what only the evaluation needs: the essay haystack read from a corpus (``load_haystack``, by default the
embedded corpus's held-out split), the per-sample seeds (``sample_seed``) and the samples with their generation
budget (``make_sample``, ``build_samples``).

Lengths are counted in model tokens: the prompt is ``[eos] + tokenizer.encode(text)`` and the haystack size n is
the largest one for which ``len(prompt) + max_new_tokens <= length``.

Every sample is reproducible from (seed, task, length, index) alone (``sample_seed``); the training retrieval mix
draws its documents from another seed namespace (docs/configuration.md, data.retrieval_mix).
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from data.niah import (
    ANSWER_PREFIX,
    DEPTHS,
    HAYSTACK_TYPES,
    NEEDLE,
    NEEDLE_TYPES,
    NOISE,
    TASK_NAMES,
    TASKS,
    TEMPLATE,
    WORDS_FILE,
    NeedleBuilder,
    NiahTask,
    PromptTooLong,
    fit_haystack,
    get_task,
    load_words,
    query_text,
    random_value,
    templates,
)

__all__ = [
    "ANSWER_PREFIX", "DEFAULT_HAYSTACK", "DEPTHS", "HAYSTACK_TYPES", "NEEDLE", "NEEDLE_TYPES", "NOISE", "TASKS",
    "TASK_NAMES", "TEMPLATE", "WORDS_FILE", "NiahTask", "Sample", "build_samples", "get_task", "load_haystack",
    "load_words", "make_sample", "query_text", "random_value", "sample_seed", "templates",
]

DEFAULT_HAYSTACK = "data/corpus/heldout.jsonl.zst"


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


def make_sample(task: str | NiahTask, *, length: int, tokenizer, index: int = 0, seed: int = 42,
                essay_words: Sequence[str] | None = None, max_new_tokens: int = 128,
                words: tuple[tuple[str, ...], tuple[str, ...]] | None = None, hint: int | None = None) -> Sample:
    """Sample ``index`` of ``task`` at ``length`` model tokens: the largest haystack with
    ``prompt_tokens + max_new_tokens <= length``.

    tokenizer: hilo's tokenizer interface (``encode``, ``eos_id``). essay_words: the essay haystack's words
    (``load_haystack()``), needed by essay tasks only. words: (adjectives, nouns), default the shipped
    data/niah_words.txt. hint: a haystack size to start the search from (e.g. the previous sample's); it changes
    only the speed, never the result. Raises ValueError when not even an empty haystack fits.
    """
    task = get_task(task) if isinstance(task, str) else task
    if task.haystack == "essay" and not essay_words:
        raise ValueError(f"task {task.name} needs the essay haystack: pass essay_words=load_haystack(...)")
    rng_seed = sample_seed(seed, task.name, length, index)
    builder = NeedleBuilder(task, random.Random(rng_seed), words or load_words(), essay_words)
    budget = length - max_new_tokens
    try:
        n = fit_haystack(builder, tokenizer, budget=budget, hint=hint)
    except PromptTooLong as e:
        raise ValueError(f"{task.name} at length {length}: the prompt without any haystack already has "
                         f"{e.tokens} tokens, over length - max_new_tokens = {budget}") from None
    prompt = builder.render(n)
    return Sample(task=task.name, length=length, index=index, seed=rng_seed, prompt=prompt,
                  input_ids=[int(tokenizer.eos_id)] + list(tokenizer.encode(prompt)), answers=list(builder.answers),
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
