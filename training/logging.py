"""Where metrics go: the console (one line per log window and per validation, and the progress bar),
<run_dir>/metrics.jsonl, <run_dir>/loss_curve.png, and W&B (online when an API key is configured, offline
otherwise, or disabled). Also the per-device peak FLOP/s used for MFU, and the filter that keeps libraries' INFO
records off the console of train.py (they stay in <run_dir>/train.log)."""
from __future__ import annotations

import json
import logging
import netrc
import os
import uuid
from pathlib import Path

import torch
from omegaconf import OmegaConf

from training.checkpoint import write_durably

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) for MFU; anything else needs trainer.peak_tflops=<number>.
_PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
                     "B200": 2250.0, "GH200": 989.0}


def peak_flops_per_device(setting, device: torch.device) -> float | None:
    """Peak FLOP/s of one device, or None when unknown (MFU is then not reported)."""
    if setting not in ("auto", None):
        return float(setting) * 1e12
    if setting is None or device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(_PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return _PEAK_BF16_TFLOPS[key] * 1e12
    return None


# the loggers whose INFO records the console shows: hilo's own packages and entry points
OWN_LOGGERS = ("training", "data", "models", "kernels", "eval_suites", "benchmarks", "train", "eval", "__main__")


class ConsoleFilter(logging.Filter):
    """The console handler's filter (conf/train.yaml's hydra.job_logging): hilo's records and every library's
    warnings and errors pass; a library's records below WARNING (accelerate's lines at every checkpoint, ...) do
    not. The file handler (<run_dir>/train.log) has no filter and keeps them all."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.split(".")[0] in OWN_LOGGERS


def _si(x: float) -> str:
    """1234567 -> '1.23M'."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= size:
            return f"{x / size:.2f}{unit}"
    return f"{x:.0f}"


def window_line(step: int, max_steps: int, metrics: dict) -> str:
    """The console line of a log window: step, loss, learning rate, gradient norm, throughput, MFU (when the
    device's peak is known: trainer.peak_tflops) and peak memory (CUDA: allocated by torch; CPU: the process's
    resident set)."""
    parts = [f"step {step}/{max_steps}", f"loss {metrics['train/loss']:.4f}", f"lr {metrics['train/lr']:.2e}",
             f"grad_norm {metrics['train/grad_norm']:.3f}", f"{_si(metrics['perf/tokens_per_s'])} tokens/s"]
    if "perf/mfu" in metrics:
        parts.append(f"MFU {100 * metrics['perf/mfu']:.1f}%")
    parts.append(f"mem {metrics['perf/mem_peak_gib']:.2f} GiB")
    return " | ".join(parts)


def validation_line(step: int, metrics: dict, seconds: float) -> str:
    """The console line of a validation: its loss, and the MQAR accuracies (overall and per slice) or the needle
    retrieval accuracies when present."""
    parts = [f"val step {step}", f"loss {metrics['val/loss']:.4f}"]
    if "val/needle_acc" in metrics:
        parts.append(f"needle_acc {metrics['val/needle_acc']:.3f} (tokens {metrics['val/needle_token_acc']:.3f})")
    if "val/mqar_acc" in metrics:
        parts.append(f"mqar_acc {metrics['val/mqar_acc']:.4f}")
        slices = {k.removeprefix("val/mqar_acc/"): v for k, v in metrics.items() if k.startswith("val/mqar_acc/")}
        if len(slices) > 1:
            parts.append(" ".join(f"{name} {acc:.3f}" for name, acc in slices.items()))
    parts.append(f"{seconds:.1f} s")
    return " | ".join(parts)


def resolve_wandb_mode(mode: str) -> str:
    """auto -> online when a W&B API key is configured, else offline; WANDB_MODE in the environment wins."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        pass
    return "offline"


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg, *, enabled: bool, group: str | None = None, resume_id: str | None = None,
                 name: str | None = None):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.jsonl = self.run_dir / "metrics.jsonl"
        self.wandb_run = None
        self.wandb_id = resume_id
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        drop_torn_last_line(self.jsonl)  # a line cut by a full disk or a kill, before this run appends after it
        mode = resolve_wandb_mode(str(cfg.logger.mode))
        if mode == "disabled":
            return
        import wandb

        self.wandb_id = resume_id or uuid.uuid4().hex[:8]  # our own id: it is saved with every checkpoint
        self.wandb_run = wandb.init(
            project=cfg.logger.project, entity=cfg.logger.entity, group=group or cfg.logger.group,
            name=name or str(cfg.name), id=self.wandb_id, resume="allow", dir=str(self.run_dir), mode=mode,
            tags=list(cfg.logger.tags or []), config=OmegaConf.to_container(cfg, resolve=True))

    def log(self, metrics: dict, step: int | None) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}}
        append_line(self.jsonl, json.dumps(record))
        if self.wandb_run is not None:
            if step is None:
                self.wandb_run.summary.update(metrics)
            else:
                self.wandb_run.log(metrics, step=step)

    def finish(self, summary: dict) -> None:
        if not self.enabled:
            return
        # Whole or not at all: a run killed here keeps its previous summary instead of an empty file.
        write_durably(self.run_dir / "summary.json", json.dumps(summary, indent=2, default=str).encode())
        plot_loss_curve(self.jsonl, self.run_dir / "loss_curve.png")
        if self.wandb_run is not None:
            self.wandb_run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
            self.wandb_run.finish()


def append_line(path: Path, line: str) -> None:
    """Append ``line`` and a newline to ``path`` whole or not at all: one unbuffered O_APPEND write (looped only
    over a short write), and on a write error (a full disk) the file is cut back to its old length before the
    error, which names the file, is raised."""
    data = (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError as e:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass  # read_metrics / drop_torn_last_line still drop the torn line
            raise OSError(e.errno, f"could not append to {path} ({e.strerror}; is the disk full?); the file is "
                                   f"left at its last whole line") from e
    finally:
        os.close(fd)


def drop_torn_last_line(jsonl: Path) -> bool:
    """Cut a last line that has no newline and is not valid JSON (a torn write) off ``jsonl``, with a warning
    naming the file; True when something was cut."""
    jsonl = Path(jsonl)
    if not jsonl.is_file():
        return False
    data = jsonl.read_bytes()
    if not data or data.endswith(b"\n"):
        return False
    keep = data.rfind(b"\n") + 1
    try:
        json.loads(data[keep:])
        return False  # a whole record that only lacks its newline
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass
    log.warning("%s: dropping a torn last line (%d bytes, no newline: a write cut short by a full disk or a kill)",
                jsonl, len(data) - keep)
    with open(jsonl, "r+b") as f:
        f.truncate(keep)
    return True


def read_metrics(jsonl: Path) -> list[dict]:
    """The records of a metrics.jsonl, in order ([] when there is none).

    A torn last line (no newline, not valid JSON: a write cut short) is dropped with a warning naming the file;
    any other line that is not a JSON object raises ValueError naming the file and the line number."""
    jsonl = Path(jsonl)
    if not jsonl.is_file():
        return []
    text = jsonl.read_bytes().decode("utf-8", errors="replace")
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):  # the last line, without a newline: a torn write
                log.warning("%s: ignoring a torn last line %d (%d characters, not valid JSON: %s)", jsonl, number,
                            len(line), e)
                continue
            raise ValueError(f"{jsonl}: line {number} is not valid JSON ({e}); the file is damaged in the middle: "
                             f"delete or fix that line") from None
        if not isinstance(record, dict):
            raise ValueError(f"{jsonl}: line {number} is a JSON {type(record).__name__}, not an object")  # noqa: TRY004
        records.append(record)
    return records


def supersede_after(jsonl: Path, step: int) -> int:
    """Before a run resumed at `step` appends to metrics.jsonl: move the records of later steps (logged by the
    training that the resume discards: after the checkpoint it continues from) to metrics.superseded.jsonl beside
    it, so each step is logged once in metrics.jsonl and nothing logged is lost. Returns how many moved."""
    jsonl = Path(jsonl)
    records = read_metrics(jsonl)
    is_later = [isinstance(r.get("step"), int) and r["step"] > step for r in records]
    later = [r for r, x in zip(records, is_later) if x]
    if not later:
        return 0
    keep = [r for r, x in zip(records, is_later) if not x]
    with open(jsonl.with_name("metrics.superseded.jsonl"), "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in later)
        f.flush()
        os.fsync(f.fileno())
    tmp = jsonl.with_name(jsonl.name + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, jsonl)
    log.warning("%s: %d records after step %d (training the resume discards) moved to %s", jsonl, len(later), step,
                jsonl.with_name("metrics.superseded.jsonl").name)
    return len(later)


def plot_loss_curve(jsonl: Path, out_png: Path) -> Path | None:
    records = read_metrics(jsonl)
    train = [(r["step"], r["train/loss"]) for r in records if "train/loss" in r and r["step"] is not None]
    val = [(r["step"], r["val/loss"]) for r in records if "val/loss" in r and r["step"] is not None]
    if not train and not val:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train")
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png
