"""The RULER NIAH run: build every (task, length) sample, decode greedily through the model's cache, score."""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .niah import TASK_NAMES, Sample, build_samples, get_task, load_haystack
from .scoring import string_match_all

# transformers' MaxLengthCriteria says a generation past config.max_position_embeddings "may" raise or degrade:
# for RULER that is the length-extrapolation cells, which evaluate announces once in its own words instead.
_PAST_MAX_LENGTH = "the current text generation call has exceeded the model's predefined maximum length"


class _DropPastMaxLength(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _PAST_MAX_LENGTH not in record.getMessage()


@contextmanager
def _without_past_max_length_reminder():
    logger = logging.getLogger("transformers.generation.stopping_criteria")
    drop = _DropPastMaxLength()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def generate_answers(model: Any, samples: Sequence[Sample], tokenizer, *,
                     device: str | torch.device = "cpu") -> list[str]:
    """Greedy decoding of a batch of samples in one ``model.generate`` call through the model's own decoding
    cache (a HiloCache for hilo models): the prompts left-padded to the longest with an attention_mask (each row
    runs as if alone, docs/design.md "Padded batches"; one sample is the plain unpadded forward), up to the
    samples' common ``max_new_tokens``, a row finishing at EOS. Returns each continuation decoded, cut before
    its first EOS."""
    if not samples:
        return []
    budgets = {sample.max_new_tokens for sample in samples}
    if len(budgets) != 1:
        raise ValueError(f"one generate() call decodes one max_new_tokens; these samples have {sorted(budgets)}")
    eos = int(tokenizer.eos_id)
    width = max(sample.prompt_tokens for sample in samples)
    ids = torch.full((len(samples), width), eos, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for row, sample in enumerate(samples):
        ids[row, width - sample.prompt_tokens:] = torch.tensor(sample.input_ids, dtype=torch.long)
        mask[row, width - sample.prompt_tokens:] = 1
    with torch.no_grad(), _without_past_max_length_reminder():
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=budgets.pop(),
                             min_new_tokens=0, do_sample=False, num_beams=1, use_cache=True, eos_token_id=eos,
                             pad_token_id=eos)
    texts = []
    for new in out[:, width:].tolist():
        texts.append(tokenizer.decode(new[:new.index(eos)] if eos in new else new))
    return texts


def generate_answer(model: Any, sample: Sample, tokenizer, *, device: str | torch.device = "cpu") -> str:
    """Greedy decoding of one sample (``generate_answers`` of a batch of one): up to ``sample.max_new_tokens``
    tokens after the prompt, stopping at EOS; the decoded continuation without the EOS."""
    return generate_answers(model, [sample], tokenizer, device=device)[0]


def evaluate(model: Any, tokenizer, *, lengths: Sequence[int], tasks: Sequence[str] = TASK_NAMES,
             num_samples: int = 25, haystack: str | Sequence[str] | None = None, haystack_field: str = "text",
             max_new_tokens: int = 128, seed: int = 42, batch_size: int = 8, device: str | torch.device = "cpu",
             predict: Callable[[Sample], str] | None = None, log: Callable[[str], None] | None = print) -> dict:
    """Run the NIAH tasks at every length and score them with string_match_all.

    model: a causal LM with ``generate`` already on ``device`` (ignored when ``predict`` is given). tokenizer:
    hilo's tokenizer interface (encode/decode/eos_id), the one the model was trained with. lengths: total
    tokens per sample (prompt + max_new_tokens budget). haystack: the essay corpus (paths/globs; None: the
    embedded corpus's held-out split). predict: a function Sample -> prediction text used instead of the
    model's greedy decoding (oracles, other generation backends). batch_size: samples of one task and length
    decoded together in one left-padded ``generate`` call (``generate_answers``; the same greedy answers as one
    at a time, to the float rounding of a padded batch; memory grows with it, as batch_size x length tokens of
    KV cache for attention layers). log: progress lines (None: silent).

    Under torch.distributed, rank r answers samples r, r + world_size, ... and the predictions are gathered,
    so every rank returns the same result.

    Returns plain Python values: suite, tasks, lengths, num_samples, seed, max_new_tokens, scores
    {task: {str(length): score}} (mean string_match_all x 100), average_by_length {str(length): mean over
    tasks}, average_by_task {task: mean over lengths}, average (mean over every task and length), and samples
    (one dict per sample: task, length, index, prompt_tokens, num_haystack, depths, queries, answers,
    prediction, score).
    """
    tasks = [get_task(name).name for name in tasks]
    lengths = [int(length) for length in lengths]
    if not tasks or not lengths:
        raise ValueError("ruler needs at least one task and one length")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int (samples per generate call), got {batch_size!r}")
    essay_words = load_haystack(haystack, haystack_field) if any(
        get_task(name).haystack == "essay" for name in tasks) else None
    samples = [sample for name in tasks for length in lengths
               for sample in build_samples(name, length=length, tokenizer=tokenizer, num_samples=num_samples,
                                           seed=seed, essay_words=essay_words, max_new_tokens=max_new_tokens)]

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    # This rank's samples in batches of one (task, length) cell each: a cell's prompts are fitted to one length,
    # so left padding adds a few tokens at most.
    batches: list[list[int]] = []
    for i in range(rank, len(samples), world):
        last = batches[-1] if batches else None
        if last and len(last) < batch_size and _cell(samples[last[0]]) == _cell(samples[i]):
            last.append(i)
        else:
            batches.append([i])
    trained = getattr(getattr(model, "config", None), "max_position_embeddings", None) if predict is None else None
    beyond = [length for length in lengths if trained is not None and length > trained]
    if log is not None and rank == 0 and beyond:
        log(f"ruler: lengths {', '.join(map(str, beyond))} go past the model's max_position_embeddings ({trained}, "
            f"its training length): those cells measure length extrapolation")
    was_training = isinstance(model, nn.Module) and model.training
    if was_training:
        model.eval()
    predictions: dict[int, str] = {}
    start = time.time()
    try:
        for b, batch in enumerate(batches):
            texts = [predict(samples[i]) for i in batch] if predict is not None else generate_answers(
                model, [samples[i] for i in batch], tokenizer, device=device)
            predictions.update(zip(batch, texts))
            cell = _cell(samples[batch[0]])
            if log is not None and rank == 0 and (b + 1 == len(batches) or _cell(samples[batches[b + 1][0]]) != cell):
                scores = [string_match_all(predictions[j], samples[j].answers) for j in predictions
                          if _cell(samples[j]) == cell]
                log(f"ruler: {cell[0]} @ {cell[1]}: {100 * _mean(scores):.1f} over {len(scores)} samples "
                    f"({batch[-1] + 1}/{len(samples)} done, {time.time() - start:.0f}s)")
    finally:
        if was_training:
            model.train()
    if world > 1:
        gathered: list[dict[int, str]] = [{} for _ in range(world)]
        dist.all_gather_object(gathered, predictions)
        predictions = {i: text for part in gathered for i, text in part.items()}
    records = [_record(sample, predictions[i]) for i, sample in enumerate(samples)]
    return summarize(records, tasks=tasks, lengths=lengths, num_samples=num_samples, seed=seed,
                     max_new_tokens=max_new_tokens)


def _cell(sample: Sample) -> tuple[str, int]:
    return sample.task, sample.length


def _record(sample: Sample, prediction: str) -> dict:
    return {"task": sample.task, "length": sample.length, "index": sample.index,
            "prompt_tokens": sample.prompt_tokens, "num_haystack": sample.num_haystack,
            "depths": [depth for _, _, depth in sample.needles], "queries": sample.queries,
            "answers": sample.answers, "prediction": prediction,
            "score": string_match_all(prediction, sample.answers)}


def summarize(records: Sequence[dict], *, tasks: Sequence[str], lengths: Sequence[int], num_samples: int,
              seed: int, max_new_tokens: int) -> dict:
    """The result dict of ``evaluate`` from per-sample records (each with task, length and score in 0..1)."""
    scores = {}
    for task in tasks:
        scores[task] = {}
        for length in lengths:
            cell = [r["score"] for r in records if r["task"] == task and r["length"] == length]
            if not cell:
                raise ValueError(f"no sample of {task} at length {length}")
            scores[task][str(length)] = 100 * math.fsum(cell) / len(cell)
    by_length = {str(length): _mean([scores[task][str(length)] for task in tasks]) for length in lengths}
    by_task = {task: _mean(list(scores[task].values())) for task in tasks}
    return {"suite": "ruler", "tasks": list(tasks), "lengths": list(lengths), "num_samples": num_samples,
            "seed": seed, "max_new_tokens": max_new_tokens, "scores": scores, "average_by_length": by_length,
            "average_by_task": by_task, "average": _mean(list(by_length.values())), "samples": list(records)}


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)
