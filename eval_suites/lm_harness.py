"""lm-evaluation-harness tasks on a hilo model: an lm-eval ``LM`` over the model and the tokenizer it was trained
with, and the run of a task list through lm-eval's own evaluator (docs/configuration.md, eval).

    from eval_suites import lm_harness
    result = lm_harness.evaluate(model, tokenizer, tasks=["lambada_openai", "piqa"], max_length=2048)
    lm_harness.write_report(result, out_dir)

Tasks are lm-eval's (their datasets download through lm-eval and HF datasets) or custom task YAMLs in
``include_path`` (local json/jsonl files through ``dataset_path: json``). The three request types are computed on
the model directly:

- ``loglikelihood``: log p(continuation | context), summed over the continuation's tokens, and whether greedy
  decoding would produce it. Rows of a batch are right-padded: a causal model's logits at a position depend only
  on the tokens up to it, so the logits read at the real positions are those of the unpadded row; no mask needed.
- ``loglikelihood_rolling``: the document's log-likelihood in disjoint windows of ``max_length`` tokens, the first
  predicted from the end-of-document token (how hilo's training stream separates documents).
- ``generate_until``: decoding through ``model.generate`` (hilo's cache) until a stop string, EOS or
  ``max_gen_toks``. Prompts of a batch are left-padded with an ``attention_mask`` (hilo's models run padded
  batches as packed documents: docs/design.md).

Under torch.distributed every rank takes its share of each task's documents (lm-eval's data-parallel protocol) and
every rank returns the same result.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from eval_suites.ppl_by_position import _finite_or_none  # the JSON of every suite: NaN / inf as null

try:
    from lm_eval.api.model import TemplateLM
except ImportError as e:  # the optional extra
    raise ImportError("eval=lm_harness needs lm-evaluation-harness: pip install -e '.[lm_eval]' "
                      "(lm-eval==0.4.13)") from e

# The downstream set of the log-linear attention paper: WikiText perplexity, LAMBADA, PIQA, HellaSwag, WinoGrande,
# ARC-e, ARC-c (all zero-shot).
DEFAULT_TASKS = ("wikitext", "lambada_openai", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge")


class HiloLM(TemplateLM):
    """An lm-eval language model over a causal LM and hilo's tokenizer interface (encode / decode / eos_id).

    model: an HF-style causal LM already on ``device`` (``model(input_ids=...).logits`` [B, T, V] and
    ``generate``). max_length: the longest row the model is given (context + continuation); longer requests lose
    their oldest tokens, and rolling log-likelihoods use windows of this many tokens. batch_size: rows per forward
    (log-likelihoods) and prompts per ``generate`` call when the model takes padding. max_gen_toks: the generation
    budget of tasks that set none.
    """

    def __init__(self, model: Any, tokenizer: Any, *, max_length: int, batch_size: int = 1, max_gen_toks: int = 256,
                 device: str | torch.device = "cpu"):
        super().__init__()
        for name, value in (("max_length", max_length), ("batch_size", batch_size), ("max_gen_toks", max_gen_toks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.model, self.tokenizer = model, tokenizer
        self.max_length, self.batch_size, self.max_gen_toks = max_length, batch_size, max_gen_toks
        self._device = torch.device(device)
        if dist.is_available() and dist.is_initialized():
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        else:
            self._rank, self._world_size = 0, 1

    # -- tokens ----------------------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_id)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return list(self.tokenizer.encode(string))

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    # -- data parallel (lm-eval's evaluator calls these when world_size > 1) ----------------------------------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list | None:
        if self._world_size == 1:
            return [obj]
        parts: list = [None] * self._world_size
        dist.all_gather_object(parts, obj)
        return parts if self._rank == dst else None

    def barrier(self) -> None:
        if self._world_size > 1:
            dist.barrier()

    # -- requests --------------------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of log p(continuation tokens), whether each is the argmax) for (key, context, continuation)
        token requests, longest first in batches of batch_size right-padded rows. The model is called with
        ``input_ids``, ``use_cache=False`` and ``logits_to_keep`` (the last positions whose logits it returns)."""
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        bar = tqdm(total=len(requests), desc="log-likelihoods", disable=disable_tqdm or self.rank != 0)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            rows, continuations = [], []
            for i in batch:
                _, context, continuation = requests[i]
                if not continuation:
                    raise ValueError(f"empty continuation after context {context[-8:]!r}: nothing to score")
                if len(continuation) > self.max_length:
                    raise ValueError(f"a continuation of {len(continuation)} tokens exceeds max_length "
                                     f"{self.max_length}; raise eval.max_length")
                # the oldest context tokens go when the row is longer than max_length (the last token is never input)
                rows.append((list(context) + list(continuation))[-(self.max_length + 1):][:-1])
                continuations.append(list(continuation))
            width = max(len(row) for row in rows)
            ids = torch.full((len(rows), width), self.eot_token_id, dtype=torch.long)
            for j, row in enumerate(rows):
                ids[j, :len(row)] = torch.tensor(row, dtype=torch.long)
            # logits only from the first continuation position of the batch on (HF's logits_to_keep): a
            # multiple-choice batch needs a few positions per row, not [B, T, V]
            first = min(len(row) - len(continuation) for row, continuation in zip(rows, continuations, strict=True))
            with torch.no_grad():
                logits = self.model(input_ids=ids.to(self.device), use_cache=False,
                                    logits_to_keep=width - first).logits
            for j, (i, row, continuation) in enumerate(zip(batch, rows, continuations, strict=True)):
                positions = slice(len(row) - len(continuation) - first, len(row) - first)
                logprobs = F.log_softmax(logits[j, positions].float(), dim=-1)
                targets = torch.tensor(continuation, dtype=torch.long, device=logprobs.device)
                total = float(logprobs.gather(-1, targets[:, None]).sum())
                greedy = bool((logprobs.argmax(dim=-1) == targets).all())
                results[i] = (total, greedy)
                key = requests[i][0]
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, results[i])
            bar.update(len(batch))
        bar.close()
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """log p(document) for each request's one string, over disjoint windows of max_length predicted tokens
        (lm-eval's rolling windows with one token of context; the first predicted from EOS)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm), strict=True):
            totals[index] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """The continuation of each prompt up to (not including) the first stop string of its task (``until``),
        EOS or max_gen_toks tokens; greedy unless the task asks for sampling."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = defaultdict(list)  # one generate() setting per group
        for i, req in enumerate(requests):
            groups[json.dumps(req.args[1], sort_keys=True, default=str)].append(i)
        rows_per_call = self.batch_size
        bar = tqdm(total=len(requests), desc="generations", disable=disable_tqdm or self.rank != 0)
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            max_context = self.max_length - max_gen_toks
            if max_context < 1:
                raise ValueError(f"max_gen_toks {max_gen_toks} leaves no room for a prompt within max_length "
                                 f"{self.max_length}; raise eval.max_length")
            kwargs.pop("max_length", None)
            if not kwargs.get("do_sample"):
                kwargs.pop("temperature", None)
            prompts = {i: self.tok_encode(requests[i].args[0])[-max_context:] or [self.prefix_token_id]
                       for i in indices}
            order = sorted(indices, key=lambda i: -len(prompts[i]))
            for start in range(0, len(order), rows_per_call):
                batch = order[start:start + rows_per_call]
                for i, text in zip(batch, self._generate([prompts[i] for i in batch], until, max_gen_toks, kwargs),
                                   strict=True):
                    results[i] = postprocess_generated_text(text, until, None)
                    self.cache_hook.add_partial("generate_until", requests[i].args, results[i])
                bar.update(len(batch))
        bar.close()
        return results

    def _generate(self, prompts: list[list[int]], until: list[str], max_new_tokens: int, kwargs: dict) -> list[str]:
        """Decode one batch of prompts (left-padded when their lengths differ); the texts, cut at EOS."""
        width = max(len(prompt) for prompt in prompts)
        eos = self.eot_token_id
        ids = torch.full((len(prompts), width), eos, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for j, prompt in enumerate(prompts):
            ids[j, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[j, width - len(prompt):] = 1
        stopping = StoppingCriteriaList([_StopStrings(until, self.tokenizer, width)] if until else [])
        with torch.no_grad():
            out = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device),
                                      max_new_tokens=max_new_tokens, min_new_tokens=0, use_cache=True,
                                      eos_token_id=eos, pad_token_id=eos, stopping_criteria=stopping,
                                      **{"do_sample": False, "num_beams": 1, **kwargs})
        texts = []
        for row in out[:, width:].tolist():
            texts.append(self.tok_decode(row[:row.index(eos)] if eos in row else row))
        return texts


class _StopStrings(StoppingCriteria):
    """A transformers stopping criterion: a row is done once its generated text contains one of the stop strings
    (decoded text, so a stop string split across tokens is found)."""

    def __init__(self, stops: Sequence[str], tokenizer: Any, prompt_width: int):
        self.stops = [stop for stop in stops if stop]
        self.tokenizer, self.prompt_width = tokenizer, prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor, **kwargs) -> torch.BoolTensor:
        done = [any(stop in self.tokenizer.decode(row) for stop in self.stops)
                for row in input_ids[:, self.prompt_width:].tolist()]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def evaluate(model: Any, tokenizer: Any, *, tasks: Sequence[str] = DEFAULT_TASKS, max_length: int,
             batch_size: int = 1, max_gen_toks: int = 256, num_fewshot: int | None = None,
             limit: float | None = None, include_path: str | Sequence[str] | None = None,
             log_samples: bool = False, bootstrap_iters: int = 100000, seed: int = 1234,
             device: str | torch.device = "cpu", task_manager: Any = None) -> dict:
    """Run lm-eval's ``tasks`` on ``model`` (through HiloLM) and return the result as plain Python values.

    tasks: lm-eval task or group names, or names of tasks defined in ``include_path`` (a directory or list of
    directories of task YAMLs, added to lm-eval's own; task_manager: an lm_eval TaskManager used instead).
    num_fewshot: None keeps each task's default. limit: documents per task (an int, or a fraction below 1; None:
    all). bootstrap_iters: resamples for the standard errors of non-mean metrics (0: none). seed: lm-eval's
    random, numpy, torch and few-shot seeds.

    Returns suite, tasks, batch_size, max_length, max_gen_toks, num_fewshot, limit, metrics ({"<task>/<metric>": value}, a metric's filter appended as
    "<metric>_<filter>" when it is not "none"; standard errors omitted), results / groups / versions / n-shot /
    n-samples / higher_is_better / configs (lm-eval's), and samples (lm-eval's per-document records) when
    ``log_samples``. Under torch.distributed every rank returns rank 0's result.
    """
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable

    tasks = [str(task) for task in tasks]
    if not tasks:
        raise ValueError("lm_harness needs at least one task (eval.tasks=[...])")
    if task_manager is None:
        paths = [include_path] if isinstance(include_path, (str, Path)) else list(include_path or [])
        for path in paths:
            if not Path(path).is_dir():
                raise FileNotFoundError(f"eval.include_path {str(path)!r} is not a directory of lm-eval task YAMLs")
        task_manager = TaskManager(include_path=[str(path) for path in paths] or None)
    unknown = [task for task in tasks if task not in task_manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s) {', '.join(unknown)}: use lm-eval's names (`lm_eval ls tasks` "
                         f"lists them) or put the task YAMLs in a directory given as eval.include_path")
    lm = HiloLM(model, tokenizer, max_length=max_length, batch_size=batch_size, max_gen_toks=max_gen_toks,
                device=device)
    was_training = isinstance(model, nn.Module) and model.training
    if was_training:
        model.eval()
    try:
        output = simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                 task_manager=task_manager, log_samples=log_samples,
                                 bootstrap_iters=bootstrap_iters, random_seed=seed, numpy_random_seed=seed,
                                 torch_random_seed=seed, fewshot_random_seed=seed)
    finally:
        if was_training:
            model.train()
    result = None
    if output is not None:  # rank 0
        output = json.loads(json.dumps(dict(output), default=handle_non_serializable))
        result = {"suite": "lm_harness", "tasks": tasks, "batch_size": batch_size, "max_length": max_length,
                  "max_gen_toks": max_gen_toks, "num_fewshot": num_fewshot, "limit": limit,
                  "metrics": metrics(output)}
        result.update({key: output[key] for key in ("results", "groups", "versions", "n-shot", "n-samples",
                                                    "higher_is_better", "configs") if key in output})
        if log_samples:
            result["samples"] = output.get("samples", {})
    if lm.world_size > 1:
        box = [result]
        dist.broadcast_object_list(box, src=0)
        result = box[0]
    return result


def metrics(output: dict) -> dict[str, float]:
    """{"<task>/<metric>": value} from lm-eval's results (and groups): numbers only, standard errors left out."""
    flat = {}
    for section in ("results", "groups"):
        for task, values in (output.get(section) or {}).items():
            for key, value in values.items():
                metric, _, filter_name = key.partition(",")
                if not filter_name or "_stderr" in metric or isinstance(value, bool) or not isinstance(
                        value, (int, float)):
                    continue
                flat[f"{task}/{metric}" + ("" if filter_name == "none" else f"_{filter_name}")] = value
    return flat


def format_table(result: dict) -> str:
    """The result as lm-eval's markdown table (task, version, filter, n-shot, metric, value, stderr)."""
    from lm_eval.utils import make_table

    table = make_table(result)
    return table + ("\n" + make_table(result, "groups") if result.get("groups") else "")


def write_report(result: dict, out_dir: str | Path) -> Path:
    """Write ``result`` to ``out_dir``/lm_harness.json (non-finite floats as null); returns the path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "lm_harness.json"
    path.write_text(json.dumps(_finite_or_none(result), indent=1, allow_nan=False))
    return path


def log_to_wandb(result: dict, run: Any, *, prefix: str = "lm_harness") -> None:
    """The metrics in ``run.summary`` under ``prefix/`` and one table (task, metric, value) in the run's log."""
    if run is None:
        return
    import wandb

    finite = {key: value for key, value in result["metrics"].items() if math.isfinite(value)}
    rows = [[*key.split("/", 1), value] for key, value in finite.items()]
    run.log({f"{prefix}/table": wandb.Table(columns=["task", "metric", "value"], data=rows)})
    run.summary.update({f"{prefix}/{key}": value for key, value in finite.items()})
