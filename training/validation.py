"""Validation during training: held-out rows of the training data and the mean next-token loss over them, the
MQAR test sets a run validates on (all of them, or the first trainer.val_batches batches of each), the held-out
needle documents of a run with data.retrieval_mix on and its teacher-forced retrieval on them, and the console
progress of a validation."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from data import iter_heldout_documents
from eval_suites.mqar import IGNORE_INDEX, labelled_logits

# trainer.val_batches=null: this many batches of held-out text (MQAR data: every test example)
DEFAULT_VAL_BATCHES = 8
# held-out needle documents a validation scores when data.retrieval_mix is on (each 1.6 points of val/needle_acc)
NEEDLE_DOCUMENTS = 64
# without a progress bar, a validation running longer than this prints a progress line this often
PROGRESS_EVERY_S = 30.0


class ValidationProgress:
    """The console progress of one validation of `total` examples: a tqdm bar under the training bar when
    trainer.progress_bar is on (gone when the validation ends), else a line through `write` every
    PROGRESS_EVERY_S seconds (none for a shorter validation). Disabled (nothing shown) off the main process.
    Call it with the number of examples just done; close() at the end."""

    def __init__(self, total: int, *, enabled: bool, bar: bool, write: Callable[[str], None], desc: str = "val"):
        self.total, self.write, self.desc = total, write, desc
        self.enabled, self.done = enabled, 0
        self.t0 = self.last = time.perf_counter()
        self.bar = tqdm(total=total, desc=desc, unit="ex", leave=False, dynamic_ncols=True) if enabled and bar else None

    def __call__(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.perf_counter()
        if self.enabled and now - self.last >= PROGRESS_EVERY_S and self.done < self.total:
            self.last = now
            self.write(f"{self.desc}: {self.done}/{self.total} examples ({100 * self.done / self.total:.0f}%), "
                       f"{now - self.t0:.0f} s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def mqar_validation_sets(test_sets: list[dict], val_batches: int | None, batch_size: int) -> list[dict]:
    """The MQAR test sets a training run validates on: all of them (val_batches None: the Zoology protocol, every
    test example), or the first val_batches * batch_size examples of each slice (a subset: val/mqar_acc is then
    the accuracy on those, not on the full test sets; eval=mqar always scores them all)."""
    if val_batches is None:
        return test_sets
    n = int(val_batches) * int(batch_size)
    return [{**t, "inputs": t["inputs"][:n], "labels": t["labels"][:n]} for t in test_sets]


def heldout_rows(data_cfg, tokenizer, seq_len: int, num_rows: int) -> torch.Tensor:
    """Held-out rows of seq_len tokens, each cut from one document (never across documents)."""
    rows = []
    for doc in iter_heldout_documents(data_cfg, tokenizer, min_tokens=seq_len, max_docs=None):
        for start in range(0, len(doc) - seq_len + 1, seq_len):
            rows.append(doc[start:start + seq_len])
            if len(rows) == num_rows:
                return torch.tensor(rows, dtype=torch.long)
    if not rows:
        raise ValueError(
            f"no held-out document has {seq_len} tokens; lower trainer.seq_len or point data.heldout at longer text")
    return torch.tensor(rows, dtype=torch.long)


def rank_rows(rows: torch.Tensor, accelerator) -> torch.Tensor:
    """The held-out rows this rank evaluates: an equal share per rank (FSDP forwards are collective), or all of
    them when there are fewer rows than ranks."""
    world, rank = accelerator.num_processes, accelerator.process_index
    usable = (len(rows) // world) * world or len(rows)
    return rows[:usable][rank::world] if usable >= world else rows


@torch.no_grad()
def evaluate_loss(model, rows: torch.Tensor, batch_size: int, accelerator,
                  progress: Callable[[int], None] | None = None) -> float:
    """Mean next-token loss over held-out rows, split across ranks and summed in float64. progress, if given, is
    called with the number of rows of each batch this rank has evaluated."""
    world = accelerator.num_processes
    usable = (len(rows) // world) * world or len(rows)
    mine = rank_rows(rows, accelerator)
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for i in range(0, len(mine), batch_size):
        batch = mine[i:i + batch_size].to(accelerator.device)
        with accelerator.autocast():  # FSDP2 models get no autocast wrapper from accelerate (see fsdp_plugin)
            out = model(input_ids=batch, labels=batch, use_cache=False, return_logits=False)
        n = batch.shape[0] * (batch.shape[1] - 1)
        total[0] += out.loss.double() * n
        total[1] += n
        if progress is not None:
            progress(batch.shape[0])
    if world > 1 and usable >= world:
        total = accelerator.reduce(total, reduction="sum")
    model.train(was_training)
    return (total[0] / total[1]).item()


def needle_set(docs, tokenizer, seq_len: int) -> dict:
    """Held-out needle documents (data.retrieval_mix.heldout_needle_documents) as a batch: inputs [N, seq_len], each
    document then EOS padding, as the training rows are; labels [N, seq_len], at each position that predicts a token
    of the answer (the reference answers after the answer prefix, their full stop included) that token, else -100;
    tasks, each row's task."""
    eos = int(tokenizer.eos_id)
    inputs = torch.full((len(docs), seq_len), eos, dtype=torch.long)
    labels = torch.full((len(docs), seq_len), IGNORE_INDEX, dtype=torch.long)
    for i, doc in enumerate(docs):
        ids = doc.input_ids  # [eos] + prompt + answer + [eos]: the answer is the tokens before the last
        n = len(tokenizer.encode(doc.answer))
        start = len(ids) - 1 - n
        inputs[i, :len(ids)] = torch.tensor(ids)
        labels[i, start - 1:start - 1 + n] = torch.tensor(ids[start:start + n])
    return {"inputs": inputs, "labels": labels, "tasks": [doc.task for doc in docs]}


@torch.no_grad()
def evaluate_needles(model, needles: dict, batch_size: int, device,
                     progress: Callable[[int], None] | None = None) -> dict:
    """Teacher-forced retrieval on the held-out needle documents of needle_set: val/needle_acc, the fraction of
    documents whose every answer token is the model's top prediction after the right prefix (so exactly the
    documents whose greedy decoding starts with the reference answer, which RULER's match passes),
    val/needle_token_acc, the fraction of answer tokens so predicted, and val/needle_acc/<task> per task when there
    are several. Unlike a RULER score, the token accuracy moves while the retrieval is forming. Every process scores
    every document (FSDP forwards are collective), so the result is the same on all of them."""
    was_training = model.training
    model.eval()
    exact, hits, tokens = [], 0, 0
    for i in range(0, len(needles["inputs"]), batch_size):
        inputs = needles["inputs"][i:i + batch_size].to(device)
        logits, mask, labels = labelled_logits(model, inputs, needles["labels"][i:i + batch_size].to(device))
        right = (logits.argmax(-1) == labels) & mask
        exact += (right.sum(-1) == mask.sum(-1)).tolist()
        hits += int(right.sum())
        tokens += int(mask.sum())
        if progress is not None:
            progress(len(inputs))
    model.train(was_training)
    metrics = {"val/needle_acc": sum(exact) / len(exact), "val/needle_token_acc": hits / tokens}
    tasks = sorted(set(needles["tasks"]))
    if len(tasks) > 1:
        for task in tasks:
            mine = [ok for ok, t in zip(exact, needles["tasks"], strict=True) if t == task]
            metrics[f"val/needle_acc/{task}"] = sum(mine) / len(mine)
    return metrics
