"""Where metrics go: the console (progress bar), <run_dir>/metrics.jsonl, <run_dir>/loss_curve.png, and W&B
(online when an API key is configured, offline otherwise, or disabled). Also the per-device peak FLOP/s used
for MFU."""
from __future__ import annotations

import json
import netrc
import os
import uuid
from pathlib import Path

import torch
from omegaconf import OmegaConf

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
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            if step is None:
                self.wandb_run.summary.update(metrics)
            else:
                self.wandb_run.log(metrics, step=step)

    def finish(self, summary: dict) -> None:
        if not self.enabled:
            return
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        plot_loss_curve(self.jsonl, self.run_dir / "loss_curve.png")
        if self.wandb_run is not None:
            self.wandb_run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
            self.wandb_run.finish()


def read_metrics(jsonl: Path) -> list[dict]:
    if not Path(jsonl).is_file():
        return []
    return [json.loads(line) for line in Path(jsonl).read_text().splitlines() if line.strip()]


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
