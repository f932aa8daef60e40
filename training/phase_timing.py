"""Step-time breakdown of the training loop (trainer.time_phases): forward (with the loss), backward, optimizer.

On CUDA each phase is bracketed by two torch.cuda.Event records on the current stream, so nothing inside the step
waits for the device; the elapsed times are read only when a log window is written, after the loop has already
synchronised (the loss reduction). The times are then the device's time between the records (kernels plus any
gap where the device waited for the host to launch). On CPU, where work is synchronous, the host clock
(time.perf_counter) brackets each phase. Disabled, every phase is a shared no-op context: no events, no clock.
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import torch

PHASES = ("forward", "backward", "optimizer")
_NOOP = nullcontext()


class PhaseTimer:
    """Sums the time of each named phase over a log window; window_metrics() gives the per-step means.

    Usage in the loop: ``with timer("forward"): ...`` around each micro step's forward (several per optimizer step
    under gradient accumulation: they add up), the same for "backward" and "optimizer"; once per log window
    ``metrics.update(timer.window_metrics(steps))``, which also starts the next window."""

    def __init__(self, device: torch.device, enabled: bool):
        self.enabled = bool(enabled)
        self.on_cuda = self.enabled and torch.device(device).type == "cuda"
        self._seconds = dict.fromkeys(PHASES, 0.0)  # host-clock sums (CPU)
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # (phase, start, end) (CUDA)

    def __call__(self, phase: str):
        if not self.enabled:
            return _NOOP
        if phase not in self._seconds:
            raise ValueError(f"unknown phase {phase!r}: expected one of {', '.join(PHASES)}")
        return self._cuda_phase(phase) if self.on_cuda else self._host_phase(phase)

    @contextmanager
    def _host_phase(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[phase] += time.perf_counter() - t0

    @contextmanager
    def _cuda_phase(self, phase: str):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            self._events.append((phase, start, end))

    def window_metrics(self, steps: int) -> dict:
        """{"perf/<phase>_s": seconds per optimizer step} over the window since the last call ({} when disabled);
        on CUDA this waits for the window's events (already done where the loop has synchronised)."""
        if not self.enabled:
            return {}
        for phase, start, end in self._events:
            end.synchronize()  # returns at once where the loop has synchronised
            self._seconds[phase] += start.elapsed_time(end) / 1e3
        out = {f"perf/{phase}_s": total / max(steps, 1) for phase, total in self._seconds.items()}
        self._seconds = dict.fromkeys(PHASES, 0.0)
        self._events = []
        return out
