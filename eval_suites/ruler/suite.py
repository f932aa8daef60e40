"""The RULER NIAH run: build every (task, length) sample, decode greedily through the model's cache, score."""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .niah import TASK_NAMES, Sample, build_samples, get_task, load_haystack
from .scoring import string_match_all


def generate_answer(model: Any, sample: Sample, tokenizer, *, device: str | torch.device = "cpu") -> str:
    """Greedy decoding of up to ``sample.max_new_tokens`` tokens after the prompt (batch 1) through
    ``model.generate`` and the model's own decoding cache (a HiloCache for hilo models); stops at EOS.
    Returns the decoded continuation without the EOS."""
    ids = torch.tensor([sample.input_ids], dtype=torch.long, device=device)
    eos = int(tokenizer.eos_id)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=sample.max_new_tokens,
                             min_new_tokens=0, do_sample=False, num_beams=1, use_cache=True, eos_token_id=eos,
                             pad_token_id=eos)
    new = out[0, ids.shape[1]:].tolist()
    if eos in new:
        new = new[:new.index(eos)]
    return tokenizer.decode(new)


def evaluate(model: Any, tokenizer, *, lengths: Sequence[int], tasks: Sequence[str] = TASK_NAMES,
             num_samples: int = 25, haystack: str | Sequence[str] | None = None, haystack_field: str = "text",
             max_new_tokens: int = 128, seed: int = 42, device: str | torch.device = "cpu",
             predict: Callable[[Sample], str] | None = None, log: Callable[[str], None] | None = print) -> dict:
    """Run the NIAH tasks at every length and score them with string_match_all.

    model: a causal LM with ``generate`` already on ``device`` (ignored when ``predict`` is given). tokenizer:
    hilo's tokenizer interface (encode/decode/eos_id), the one the model was trained with. lengths: total
    tokens per sample (prompt + max_new_tokens budget). haystack: the essay corpus (paths/globs; None: the
    embedded corpus's held-out split). predict: a function Sample -> prediction text used instead of the
    model's greedy decoding (oracles, other generation backends). log: progress lines (None: silent).

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
    essay_words = load_haystack(haystack, haystack_field) if any(
        get_task(name).haystack == "essay" for name in tasks) else None
    samples = [sample for name in tasks for length in lengths
               for sample in build_samples(name, length=length, tokenizer=tokenizer, num_samples=num_samples,
                                           seed=seed, essay_words=essay_words, max_new_tokens=max_new_tokens)]

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    was_training = isinstance(model, nn.Module) and model.training
    if was_training:
        model.eval()
    predictions: dict[int, str] = {}
    start = time.time()
    try:
        for i in range(rank, len(samples), world):
            sample = samples[i]
            predictions[i] = predict(sample) if predict is not None else generate_answer(
                model, sample, tokenizer, device=device)
            following = samples[i + world] if i + world < len(samples) else None
            if log is not None and rank == 0 and (following is None or (following.task, following.length) != (
                    sample.task, sample.length)):
                cell = [string_match_all(predictions[j], samples[j].answers) for j in predictions
                        if (samples[j].task, samples[j].length) == (sample.task, sample.length)]
                log(f"ruler: {sample.task} @ {sample.length}: {100 * _mean(cell):.1f} over {len(cell)} samples "
                    f"({i + 1}/{len(samples)} done, {time.time() - start:.0f}s)")
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
