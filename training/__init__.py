"""The trainer (training.trainer: setup, step, validate, save, resume; train.py hands it the composed config) and
its concerns, shared with eval.py: config checks, optimizer and lr schedule, checkpoints, validation, metrics logging,
the step-time breakdown, compiling the blocks, per-rank data hashes."""
from training.checkpoint import (
    CheckpointManager,
    load_checkpoint_config,
    load_checkpoint_model,
    load_checkpoint_tokenizer,
    resolve_checkpoint,
)
from training.compile import CompileUnavailableError, compile_blocks
from training.config import ConfigError, validate_train_config
from training.data_hashes import DataHashWriter
from training.logging import MetricsLogger, peak_flops_per_device, plot_loss_curve, resolve_wandb_mode
from training.optim import build_lr_schedule, build_optimizer, local_grad_norm, lr_multiplier, split_decay_groups
from training.phase_timing import PhaseTimer

__all__ = ["CheckpointManager", "CompileUnavailableError", "ConfigError", "DataHashWriter", "MetricsLogger", "PhaseTimer",
           "build_lr_schedule", "build_optimizer", "compile_blocks", "load_checkpoint_config", "load_checkpoint_model",
           "load_checkpoint_tokenizer", "local_grad_norm", "lr_multiplier", "peak_flops_per_device", "plot_loss_curve",
           "resolve_checkpoint", "resolve_wandb_mode", "split_decay_groups", "validate_train_config"]
