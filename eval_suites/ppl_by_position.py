"""Perplexity by position: how well a causal LM predicts token p given the p tokens before it.

Positions are 1-indexed context lengths throughout: position p (1 <= p <= seq_len) is the prediction of token
index p (0-indexed) of a document from its tokens 0..p-1, so ``per_position_nll[p - 1]`` is

    mean over documents d of  -log softmax(model(d[:seq_len])[p - 1])[d[p]]

Every document contributes exactly one prediction per position; documents are never packed together, so
position p always means "p tokens of this document as context". All bucket and curve ranges are half-open
``[start, end)`` in these positions.

Entry points: ``evaluate`` (the measurement, all-reduced across ranks when torch.distributed is initialised),
``write_report`` (JSON + PNG) and ``log_to_wandb``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Elements of one fp32 [B, positions, V] slice normalised at a time: 2**25 floats = 128 MiB, so a 16K-token row
# over a 32K vocabulary is normalised 1024 positions at a time instead of as a 2 GiB fp32 copy of the logits.
_CE_CHUNK_ELEMENTS = 2**25
_LINEAR_BUCKET_WIDTH = 2048
_WANDB_CURVE_POINTS = 256

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# Scalars copied to the W&B summary (None values are skipped).
_SUMMARY_KEYS = (
    "seq_len",
    "train_len",
    "num_documents",
    "nll",
    "ppl",
    "ppl_before_train_len",
    "ppl_after_train_len",
)


def evaluate(
    model: Any,
    documents: Sequence[Sequence[int]],
    *,
    seq_len: int,
    batch_size: int = 1,
    device: str | torch.device = "cpu",
    train_len: int | None = None,
    dtype: str | torch.dtype | None = None,
    smooth_window: int | None = None,
) -> dict:
    """Per-position NLL of ``model`` on the first ``seq_len + 1`` tokens of each document.

    model: a callable HF-style causal LM, already on ``device``; ``model(input_ids=LongTensor[B, seq_len])``
        returns an object with ``.logits`` [B, seq_len, V] (a tuple/list whose first item is the logits, or the
        logits tensor itself, is accepted too). nn.Modules are put in eval mode for the call and restored after.
    documents: token-id sequences (lists, numpy arrays or 1-D tensors), each with at least ``seq_len + 1``
        tokens; a shorter one raises ValueError (it cannot fill every position, and documents are never packed
        to make up the length). Inputs are ``doc[:seq_len]``, targets ``doc[1:seq_len + 1]``.
    batch_size: documents per forward call (per rank). The result does not depend on it.
    dtype: autocast dtype for the forward (``torch.bfloat16``, "bf16", ...); None or float32 runs without
        autocast. The cross entropy is always computed in fp32 and accumulated in float64.
    train_len: the training context length, marked in the report and splitting ppl into positions
        ``<= train_len`` and ``> train_len``.
    smooth_window: width of the centred moving average of ``per_position_nll`` (truncated at both ends);
        default ``max(1, seq_len // 64)``.

    Under torch.distributed, rank r evaluates ``documents[r::world_size]`` and the float64 per-position sums and
    counts are all-reduced (SUM), so every rank returns the same dict. Every rank must pass the same documents.

    Returns a dict of plain Python values: seq_len, train_len, num_documents, num_predictions, world_size, dtype,
    nll / ppl (mean NLL over all predictions and its exp), ppl_before_train_len / ppl_after_train_len (positions
    <= train_len / > train_len; None without train_len, or when nothing lies beyond it), per_position_nll
    [seq_len], smooth_window, smoothed_nll and smoothed_ppl [seq_len], cumulative_ppl [seq_len] (entry p - 1 is
    exp of the mean NLL over positions <= p), linear_bucket_width (2048, or seq_len // 8 when seq_len <= 2048),
    linear_buckets and log2_buckets ([1, 2), [2, 4), ...), each bucket {"start", "end", "nll", "ppl"} with the
    last one cut at seq_len + 1.
    """
    _check_positive_int("seq_len", seq_len)
    _check_positive_int("batch_size", batch_size)
    if train_len is not None:
        _check_positive_int("train_len", train_len)
    if smooth_window is not None:
        _check_positive_int("smooth_window", smooth_window)
    autocast_dtype = _resolve_dtype(dtype)
    device = torch.device(device)

    documents = list(documents)
    window = seq_len + 1
    if not documents:
        raise ValueError(
            f"ppl_by_position got no documents; it needs held-out documents of at least seq_len + 1 = {window} "
            f"tokens each, e.g. data.loader.iter_heldout_documents(data_cfg, tokenizer, min_tokens={window}, "
            f"max_docs=...)."
        )
    lengths = [len(doc) for doc in documents]
    too_short = sum(length < window for length in lengths)
    if too_short:
        raise ValueError(
            f"{too_short} of {len(documents)} documents have fewer than seq_len + 1 = {window} tokens "
            f"(shortest: {min(lengths)}). Documents are never packed together, so each must fill the whole "
            f"window: pass only documents with at least {window} tokens (e.g. "
            f"data.loader.iter_heldout_documents(..., min_tokens={window}, ...)) or lower seq_len"
            + (" (no document qualifies at this seq_len)." if too_short == len(documents) else ".")
        )

    rank, world_size = _dist_rank_and_world_size()
    local_documents = documents[rank::world_size]
    # Every rank runs the same number of forwards: sharded models (FSDP) all-gather weights inside forward, so a
    # rank that stopped early would leave the others waiting. A rank out of documents runs a stand-in batch that
    # is not counted.
    num_batches = math.ceil(math.ceil(len(documents) / world_size) / batch_size)

    nll_sums = torch.zeros(seq_len, dtype=torch.float64)
    counts = torch.zeros(seq_len, dtype=torch.float64)
    was_training = isinstance(model, nn.Module) and model.training
    if was_training:
        model.eval()
    autocast = (
        torch.autocast(device_type=device.type, dtype=autocast_dtype)
        if autocast_dtype is not None and autocast_dtype != torch.float32
        else nullcontext()
    )
    try:
        with torch.no_grad():
            for batch_idx in range(num_batches):
                batch = local_documents[batch_idx * batch_size : (batch_idx + 1) * batch_size]
                counted = bool(batch)
                if not counted:
                    batch = (local_documents or documents)[:1]
                tokens = torch.stack([torch.as_tensor(doc[:window], dtype=torch.long) for doc in batch])
                tokens = tokens.to(device)
                inputs, targets = tokens[:, :-1], tokens[:, 1:]
                with autocast:
                    logits = _logits_of(model(input_ids=inputs))
                if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(inputs.shape):
                    raise ValueError(
                        f"model returned logits of shape {tuple(logits.shape)} for input_ids of shape "
                        f"{tuple(inputs.shape)}; expected [B, T, V] with logits for every position"
                    )
                if counted:
                    token_nll = _token_nll(logits, targets)
                    # .cpu() before .double(): some accelerators (MPS) have no float64.
                    nll_sums += token_nll.cpu().double().sum(dim=0)
                    counts += len(batch)
    finally:
        if was_training:
            model.train()

    if world_size > 1:
        stats = torch.stack([nll_sums, counts])
        # NCCL only reduces CUDA tensors; gloo and others take CPU tensors.
        comm_device = (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        )
        stats = stats.to(comm_device)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        nll_sums, counts = stats.cpu().unbind(0)

    return _summarize(
        nll_sums,
        counts,
        train_len=train_len,
        smooth_window=smooth_window,
        num_documents=len(documents),
        world_size=world_size,
        dtype=None if autocast_dtype is None else str(autocast_dtype).removeprefix("torch."),
    )


def _summarize(
    nll_sums: torch.Tensor,
    counts: torch.Tensor,
    *,
    train_len: int | None,
    smooth_window: int | None,
    num_documents: int,
    world_size: int,
    dtype: str | None,
) -> dict:
    """Turn float64 per-position NLL sums and prediction counts [seq_len] into the result dict."""
    seq_len = nll_sums.numel()
    per_position_nll = nll_sums / counts
    window = smooth_window if smooth_window is not None else max(1, seq_len // 64)
    smoothed_nll = _centred_moving_average(per_position_nll, window)
    cumulative_nll = nll_sums.cumsum(0) / counts.cumsum(0)

    linear_width = _LINEAR_BUCKET_WIDTH if seq_len > _LINEAR_BUCKET_WIDTH else max(1, seq_len // 8)
    linear_bounds = [(start, min(start + linear_width, seq_len + 1)) for start in range(1, seq_len + 1, linear_width)]
    log2_bounds = []
    start = 1
    while start <= seq_len:
        log2_bounds.append((start, min(2 * start, seq_len + 1)))
        start *= 2

    overall_nll = _range_nll(nll_sums, counts, 1, seq_len + 1)
    result = {
        "seq_len": seq_len,
        "train_len": train_len,
        "num_documents": num_documents,
        "num_predictions": int(counts.sum().item()),
        "world_size": world_size,
        "dtype": dtype,
        "nll": overall_nll,
        "ppl": _exp(overall_nll),
        "ppl_before_train_len": None,
        "ppl_after_train_len": None,
        "smooth_window": window,
        "linear_bucket_width": linear_width,
        "linear_buckets": [_bucket(nll_sums, counts, start, end) for start, end in linear_bounds],
        "log2_buckets": [_bucket(nll_sums, counts, start, end) for start, end in log2_bounds],
        "per_position_nll": per_position_nll.tolist(),
        "smoothed_nll": smoothed_nll.tolist(),
        "smoothed_ppl": smoothed_nll.exp().tolist(),
        "cumulative_ppl": cumulative_nll.exp().tolist(),
    }
    if train_len is not None:
        result["ppl_before_train_len"] = _exp(_range_nll(nll_sums, counts, 1, min(train_len, seq_len) + 1))
        if train_len < seq_len:
            result["ppl_after_train_len"] = _exp(_range_nll(nll_sums, counts, train_len + 1, seq_len + 1))
    return result


def write_report(result: dict, out_dir: str | Path, *, title: str | None = None) -> tuple[Path, Path]:
    """Write ``result`` (from ``evaluate``) to ``out_dir``/ppl_by_position.{json,png}; returns (json, png) paths.

    The JSON holds the whole result (non-finite floats, e.g. an overflowing ppl, become null so the file stays
    valid JSON). The PNG has two panels over position (log x axis): raw and smoothed per-position NLL, and
    smoothed per-position plus cumulative perplexity; a dashed vertical line marks train_len when set.
    """
    # Figure + Agg canvas directly: no pyplot, so no global backend switch or figure registry in the caller.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "ppl_by_position.json"
    png_path = out_dir / "ppl_by_position.png"
    with open(json_path, "w") as f:
        json.dump(_finite_or_none(result), f, indent=1, allow_nan=False)

    seq_len = result["seq_len"]
    train_len = result.get("train_len")
    positions = range(1, seq_len + 1)
    if title is None:
        title = f"Perplexity by position ({result['num_documents']} documents, seq_len {seq_len})"

    fig = Figure(figsize=(9, 7), constrained_layout=True)
    FigureCanvasAgg(fig)
    ax_nll, ax_ppl = fig.subplots(2, 1, sharex=True)
    ax_nll.plot(positions, result["per_position_nll"], lw=0.5, alpha=0.3, color="tab:blue", label="per position")
    ax_nll.plot(
        positions,
        result["smoothed_nll"],
        lw=1.5,
        color="tab:blue",
        label=f"moving average ({result['smooth_window']} positions)",
    )
    ax_nll.set_ylabel("NLL (nats)")
    ax_ppl.plot(positions, result["smoothed_ppl"], lw=1.5, color="tab:blue", label="per position (smoothed)")
    ax_ppl.plot(positions, result["cumulative_ppl"], lw=1.5, color="tab:orange", label="cumulative (positions <= p)")
    ax_ppl.set_ylabel("perplexity")
    ax_ppl.set_xlabel("position p (tokens of context)")
    for ax in (ax_nll, ax_ppl):
        ax.set_xscale("log")
        ax.grid(True, which="both", alpha=0.3)
        if train_len is not None:
            ax.axvline(train_len, color="tab:red", ls="--", lw=1, label=f"train length {train_len}")
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(f"{title}\noverall ppl {result['ppl']:.4g}")
    fig.savefig(png_path, dpi=120)
    return json_path, png_path


def log_to_wandb(result: dict, run: Any, *, prefix: str = "ppl_by_position") -> None:
    """Log ``result`` to a W&B run: bucket tables with ppl line plots, a log-spaced curve table, and the scalars
    of ``_SUMMARY_KEYS`` in ``run.summary`` under ``prefix/``. Does nothing when ``run`` is None; wandb is
    imported only here."""
    if run is None:
        return
    import wandb

    columns = ["start", "end", "nll", "ppl"]
    logs = {}
    for kind in ("linear", "log2"):
        rows = [[b["start"], b["end"], b["nll"], b["ppl"]] for b in result[f"{kind}_buckets"]]
        table = wandb.Table(columns=columns, data=rows)
        logs[f"{prefix}/{kind}_buckets"] = table
        logs[f"{prefix}/{kind}_buckets_ppl"] = wandb.plot.line(
            table, "start", "ppl", title=f"ppl by position ({kind} buckets)"
        )
    # A few hundred log-spaced positions keep the curve readable in W&B without logging seq_len rows.
    seq_len = result["seq_len"]
    sampled = sorted(
        {round(seq_len ** (i / (_WANDB_CURVE_POINTS - 1))) for i in range(_WANDB_CURVE_POINTS)} | {1, seq_len}
    )
    curve = wandb.Table(
        columns=["position", "smoothed_nll", "smoothed_ppl", "cumulative_ppl"],
        data=[
            [p, result["smoothed_nll"][p - 1], result["smoothed_ppl"][p - 1], result["cumulative_ppl"][p - 1]]
            for p in sampled
        ],
    )
    logs[f"{prefix}/curve"] = curve
    logs[f"{prefix}/cumulative_ppl"] = wandb.plot.line(curve, "position", "cumulative_ppl", title="cumulative ppl")
    run.log(logs)
    run.summary.update({f"{prefix}/{key}": result[key] for key in _SUMMARY_KEYS if result.get(key) is not None})


def _token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log softmax(logits)[targets] in fp32, [B, T, V] x [B, T] -> [B, T], normalising a slice of positions at a
    time so at most ``_CE_CHUNK_ELEMENTS`` logits exist in fp32 at once."""
    batch, length, vocab = logits.shape
    chunk = max(1, _CE_CHUNK_ELEMENTS // max(1, batch * vocab))
    nll = torch.empty(batch, length, dtype=torch.float32, device=logits.device)
    for start in range(0, length, chunk):
        end = min(length, start + chunk)
        piece = logits[:, start:end].float()
        target_logit = piece.gather(-1, targets[:, start:end, None]).squeeze(-1)
        nll[:, start:end] = torch.logsumexp(piece, dim=-1) - target_logit
    return nll


def _centred_moving_average(values: torch.Tensor, window: int) -> torch.Tensor:
    """Mean of values[i - window // 2 : i - window // 2 + window] for each i, the slice clipped to the array."""
    length = values.numel()
    prefix = torch.cat([values.new_zeros(1), values.cumsum(0)])
    unclipped_lo = torch.arange(length) - window // 2
    lo = unclipped_lo.clamp(min=0)
    hi = (unclipped_lo + window).clamp(max=length)
    return (prefix[hi] - prefix[lo]) / (hi - lo).to(values.dtype)


def _range_nll(nll_sums: torch.Tensor, counts: torch.Tensor, start: int, end: int) -> float:
    """Mean NLL over the predictions at positions [start, end) (1-indexed)."""
    return (nll_sums[start - 1 : end - 1].sum() / counts[start - 1 : end - 1].sum()).item()


def _bucket(nll_sums: torch.Tensor, counts: torch.Tensor, start: int, end: int) -> dict:
    nll = _range_nll(nll_sums, counts, start, end)
    return {"start": start, "end": end, "nll": nll, "ppl": _exp(nll)}


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(item) for item in value]
    return value


def _logits_of(output: Any) -> torch.Tensor:
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, torch.Tensor):
        logits = output
    if logits is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        logits = output[0]
    if logits is None:
        raise TypeError(f"model output of type {type(output).__name__} has no .logits")
    return logits


def _resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected a torch.dtype or one of {sorted(_DTYPES)}") from None


def _dist_rank_and_world_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
