"""Stopping a run that no longer trains: N consecutive non-finite steps raise NonFiniteLossError.

A step is non-finite when its loss or its gradient norm is NaN or inf; the loop skips its update (parameters and
optimizer state stay as they were), so a run whose every step is non-finite would otherwise go on saving the same
frozen weights. The guard counts on the device (``update``, no host sync per step) and is read where the loop
already waits for the device (``check``: the log window, before a save, at the end), so it stops within one log
window of the N-th consecutive non-finite step (docs/robustness.md).
"""
from __future__ import annotations

import torch


class NonFiniteLossError(RuntimeError):
    """Too many consecutive non-finite steps; the message names the steps and the way out."""


class NonFiniteGuard:
    """Counts consecutive non-finite steps; ``check`` raises NonFiniteLossError once a streak reaches
    ``max_consecutive`` (trainer.max_nonfinite_steps; None disables the guard)."""

    def __init__(self, max_consecutive: int | None, device: torch.device | str = "cpu"):
        if max_consecutive is not None and (isinstance(max_consecutive, bool) or not isinstance(max_consecutive, int)
                                            or max_consecutive < 1):
            raise ValueError(f"trainer.max_nonfinite_steps={max_consecutive!r}: expected an integer >= 1, or null "
                             f"to never stop on non-finite steps")
        self.max_consecutive = max_consecutive
        zero = torch.zeros((), dtype=torch.long, device=device)
        self.streak = zero.clone()        # non-finite steps in a row up to the last update
        self.worst = zero.clone()         # longest streak since the last check
        self.worst_end = zero.clone()     # the step that ended it

    def update(self, finite: torch.Tensor | bool, step: int) -> None:
        """Record step ``step`` (finite: a bool or 0-dim bool tensor, the same on every rank). No host sync."""
        finite = torch.as_tensor(finite, device=self.streak.device)
        self.streak = torch.where(finite, torch.zeros_like(self.streak), self.streak + 1)
        longer = self.streak > self.worst
        self.worst = torch.where(longer, self.streak, self.worst)
        self.worst_end = torch.where(longer, torch.full_like(self.worst_end, step), self.worst_end)

    def check(self, last_checkpoint: str | None = None) -> None:
        """Raise NonFiniteLossError if a streak of at least max_consecutive steps was recorded since the last
        check (a host sync). ``last_checkpoint`` is named in the message as the one to go back to."""
        if self.max_consecutive is None:
            return
        worst, end = int(self.worst), int(self.worst_end)
        self.worst = self.streak.clone()
        self.worst_end = torch.full_like(self.worst_end, end)
        if worst >= self.max_consecutive:
            kept = (f"the last good checkpoint is kept: {last_checkpoint}" if last_checkpoint else
                    "no checkpoint was saved")
            raise NonFiniteLossError(
                f"{worst} consecutive non-finite steps (loss or gradient NaN/inf, updates skipped), steps "
                f"{end - worst + 1}-{end}: stopping (trainer.max_nonfinite_steps={self.max_consecutive}); {kept}. "
                f"Lower optim.lr (or raise optim.warmup_steps), check the data, or raise "
                f"trainer.max_nonfinite_steps")
