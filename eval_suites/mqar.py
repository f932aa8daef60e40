"""MQAR accuracy (the Zoology protocol): argmax of the logits at every query position against its value.

Test sets come from data.mqar.build_test_sets (labels at the query positions: ``labels[q]`` is the value the logits
computed at position q, after reading the key, must predict; see data/mqar.py). ``evaluate`` scores a model on
every slice (one (seq_len, num_kv_pairs) setting each) and returns

    {"acc": the mean over all test examples of each example's accuracy over its queries (Zoology's valid/accuracy,
            whose protocol the log-linear paper follows; with as many examples in every slice, the mean of the
            slices' accuracies),
     "query_acc": accuracy over all queries of all slices (each query counts once, so slices with more pairs weigh
                  more: lower than acc while the long slices fail),
     "loss": mean cross-entropy of the logits at the query positions (nats),
     "slices": {"T256_kv4": {"acc", "loss", "num_queries", "num_examples", "seq_len", "num_kv_pairs"}, ...},
     "num_queries": total, "num_examples": total}

A slice's acc is the mean of its examples' accuracies (each of its examples has num_kv_pairs queries, so it is also
the accuracy over its queries). ``metrics(result)`` flattens it to the names train.py logs: val/mqar_acc,
val/mqar_query_acc, val/mqar_acc/<slice>, val/loss;
``format_table`` prints it and ``write_report`` saves it as JSON (eval.py eval=mqar).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def labelled_logits(model: Any, inputs: torch.Tensor, labels: torch.Tensor):
    """The model's logits where some row of the batch has a label (labels[t] is what the logits at t must predict,
    IGNORE_INDEX elsewhere), with the mask and labels at the same positions: (logits [B, K, V], mask [B, K], labels
    [B, K]). The LM head runs only at those positions (HF's logits_to_keep; a model that returns [B, T, V] is read at
    them), since the batch's logits are most of an evaluation's memory."""
    mask = labels != IGNORE_INDEX
    keep = mask.any(0).nonzero().squeeze(-1)
    logits = model(input_ids=inputs, use_cache=False, logits_to_keep=keep).logits
    if logits.shape[1] != inputs.shape[1]:  # the model kept those positions (else it returned every one)
        mask, labels = mask[:, keep], labels[:, keep]
    return logits, mask, labels


@torch.no_grad()
def evaluate(model: Any, test_sets: Sequence[dict], batch_size: int, device: torch.device | str | None = None,
             progress: Callable[[int], None] | None = None) -> dict:
    """Accuracy and loss of ``model`` on the MQAR test sets (dicts with name, seq_len, num_kv_pairs, inputs [N, T],
    labels [N, T]); see the module docstring. The model is called as model(input_ids=..., use_cache=False,
    logits_to_keep=positions).logits, [B, len(positions), V]: the logits at the positions that hold a query in some
    row of the batch, as HF models take logits_to_keep (a model that returns [B, T, V] is read at those positions).

    Every process evaluates every example (no reduction across ranks), so the result is the same on all of them.
    The model's training mode is restored afterwards. progress, if given, is called with the number of examples of
    each batch once it is scored (a console progress display).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not test_sets:
        raise ValueError("no MQAR test sets to evaluate (data.test is empty)")
    if device is None:
        device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    slices = {}
    correct_all = queries_all = examples_all = 0
    loss_all = example_acc_all = 0.0
    for test in test_sets:
        correct = queries = 0
        loss_sum = example_acc_sum = 0.0
        for i in range(0, len(test["inputs"]), batch_size):
            inputs = test["inputs"][i:i + batch_size].to(device)
            labels = test["labels"][i:i + batch_size].to(device)
            per_example = (labels != IGNORE_INDEX).sum(-1)
            if bool((per_example == 0).any()):
                raise ValueError(f"MQAR test slice {test['name']} has an example without labelled positions")
            logits, mask, labels = labelled_logits(model, inputs, labels)
            picked, targets = logits[mask].float(), labels[mask]
            hits = torch.zeros_like(mask)
            hits[mask] = picked.argmax(-1) == targets
            correct += int(hits.sum())
            example_acc_sum += float((hits.sum(-1).double() / per_example).sum())
            loss_sum += float(F.cross_entropy(picked, targets, reduction="sum"))
            queries += int(mask.sum())
            if progress is not None:
                progress(len(inputs))
        examples = len(test["inputs"])
        if examples == 0:
            raise ValueError(f"MQAR test slice {test['name']} has no examples")
        slices[test["name"]] = {"acc": example_acc_sum / examples, "loss": loss_sum / queries,
                                "num_queries": queries, "num_examples": examples,
                                "seq_len": int(test["seq_len"]), "num_kv_pairs": int(test["num_kv_pairs"])}
        correct_all, queries_all, loss_all = correct_all + correct, queries_all + queries, loss_all + loss_sum
        example_acc_all, examples_all = example_acc_all + example_acc_sum, examples_all + examples
    model.train(was_training)
    return {"acc": example_acc_all / examples_all, "query_acc": correct_all / queries_all,
            "loss": loss_all / queries_all, "slices": slices, "num_queries": queries_all,
            "num_examples": examples_all}


def metrics(result: dict, prefix: str = "val") -> dict[str, float]:
    """The flat metric names of a result: <prefix>/mqar_acc, <prefix>/mqar_query_acc, <prefix>/mqar_acc/<slice>,
    <prefix>/loss."""
    out = {f"{prefix}/loss": result["loss"], f"{prefix}/mqar_acc": result["acc"],
           f"{prefix}/mqar_query_acc": result["query_acc"]}
    out.update({f"{prefix}/mqar_acc/{name}": s["acc"] for name, s in result["slices"].items()})
    return out


def format_table(result: dict) -> str:
    """A plain-text table: one line per slice (accuracy %, queries), the overall accuracy (the mean over examples)
    and the accuracy over all queries."""
    lines = [f"{'slice':<16}{'acc %':>8}{'queries':>10}"]
    for name, s in result["slices"].items():
        lines.append(f"{name:<16}{100 * s['acc']:>8.2f}{s['num_queries']:>10}")
    lines.append(f"{'all':<16}{100 * result['acc']:>8.2f}{result['num_queries']:>10}")
    lines.append(f"{'all, per query':<16}{100 * result['query_acc']:>8.2f}{result['num_queries']:>10}")
    return "\n".join(lines)


def write_report(result: dict, out_dir: str | Path) -> Path:
    """Write <out_dir>/mqar.json (the whole result); return its path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "mqar.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    return path
