"""Small configs and runners shared by the trainer tests."""
from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"

SMALL = [
    "model/size=tiny", "trainer.seq_len=64", "trainer.batch_size=4", "trainer.max_steps=6",
    "trainer.log_every=1", "trainer.val_every=3", "trainer.val_batches=2", "trainer.save_every=3",
    "trainer.keep_last=5", "trainer.progress_bar=false", "logger=none", "optim.warmup_steps=2", "optim.lr=3e-3",
]


def small_cfg(*overrides, config_name="train"):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=config_name, overrides=[*SMALL, *overrides])


def run_train(cfg, run_dir):
    from accelerate.state import AcceleratorState, GradientState

    import train

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return train.run(cfg, run_dir=run_dir)


def metrics(run_dir) -> list[dict]:
    from training.logging import read_metrics

    return read_metrics(Path(run_dir) / "metrics.jsonl")


def nan_training_losses(monkeypatch, steps) -> None:
    """Make the loss of the training forwards numbered in `steps` (1-based, a container) NaN."""
    from models import HiloForCausalLM

    original = HiloForCausalLM.forward
    calls = {"n": 0}

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.training:
            calls["n"] += 1
            if calls["n"] in steps:
                out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(HiloForCausalLM, "forward", forward)
