"""hilo pretraining entry point.

    python train.py                                   # tiny Transformer on the embedded corpus (CPU or GPU)
    python train.py model=transformer model/size=340m data=long_data_collections trainer.seq_len=16384
    python train.py -m optim.lr=1e-3,3e-3             # a sweep: one job (and one W&B run) per point
    accelerate launch --config_file conf/accelerate/ddp.yaml train.py ...

Hydra composes conf/train.yaml (docs/configuration.md) and hands it to the trainer of training/trainer.py;
`run(cfg)` is that trainer, callable in-process by tests and notebooks. Everything a checkpoint needs to continue
bit for bit (model, optimizer, schedule, every rank's loader state and RNG, step, tokens, W&B id) is written
atomically; `trainer.resume=auto` picks the newest one. The run directory is ${paths.runs}/<name>: absolute, the same
from any working directory (conf/paths/default.yaml).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

REPO_ROOT = Path(__file__).resolve().parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from training.config import anchor_paths  # registers ${hilo.root:} (conf/paths/default.yaml) before Hydra composes
from training.trainer import run

__all__ = ["main", "run"]


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    anchor_paths(cfg)
    hc = HydraConfig.get()
    group = run_name = None
    if hc.mode == RunMode.MULTIRUN:  # one W&B run per sweep point, grouped by sweep, named by its overrides
        group = cfg.logger.group or Path(hc.sweep.dir).name
        run_name = f"{group}/{hc.job.num}: {' '.join(hc.overrides.task)}"
    summary = run(cfg, run_dir=hc.runtime.output_dir, group=group, run_name=run_name)
    print(json.dumps(summary, indent=None, default=str))
    return summary["val_loss"]  # lets Hydra sweepers minimise it


if __name__ == "__main__":
    main()
