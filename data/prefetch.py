"""Loader wrappers: world-size-invariant row sharding, and a background thread that prepares batches ahead.

Both keep the loader's exact-resume contract: ``state_dict()`` describes the position right after the last batch
the caller received, whatever has been prepared beyond it.
"""
from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Mapping

import torch


class RowShardedLoader:
    """Every rank reads the whole stream and keeps its slice of each global batch.

    The global batch (``batch_size * world_size`` rows) is then the same rows whatever the number of processes,
    so a run on N processes sees exactly the data of the 1-process run at the same global batch (useful to check
    multi-GPU training against one GPU). Each rank tokenizes the whole stream, so this costs world_size times the
    tokenizer work of document sharding (data.shard=documents, the default)."""

    def __init__(self, global_loader, *, rank: int, world_size: int, batch_size: int, seq_len: int):
        self.inner = global_loader
        self.rank, self.world_size, self.batch_size, self.seq_len = rank, world_size, batch_size, seq_len

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self.inner)
        r, b, t = self.rank, self.batch_size, self.seq_len
        if "cu_seqlens" not in batch:
            return {k: v[r * b:(r + 1) * b] for k, v in batch.items()}
        start, end = r * b * t, (r + 1) * b * t
        cu = batch["cu_seqlens"]
        # segments never cross a row boundary (the packer cuts at every multiple of seq_len)
        cu = cu[(cu >= start) & (cu <= end)] - start
        out = {k: v[:, start:end] for k, v in batch.items() if k != "cu_seqlens"}
        out["cu_seqlens"] = cu
        return out

    @property
    def stats(self) -> dict:
        return self.inner.stats

    def state_dict(self) -> dict:
        return {"row_shard": [self.rank, self.world_size], "global_rows": self.batch_size * self.world_size,
                "inner": self.inner.state_dict()}

    def load_global_state(self, sd: Mapping) -> None:
        """Continue the global stream from any rank's state of a run with another number of processes. The rows
        come off one token buffer in order whatever the batch size (a batch takes its rows from the buffer and
        reads documents only to refill it), so the stream continues exactly with any batch size and world size."""
        if "inner" not in sd:
            raise ValueError(f"not a row-sharded loader state (keys {sorted(sd)})")
        self.inner.load_state_dict(sd["inner"])

    def load_state_dict(self, sd: Mapping) -> None:
        if list(sd.get("row_shard", [])) != [self.rank, self.world_size]:
            raise ValueError(f"loader state {sd.get('row_shard')} is not for row-sharded rank "
                             f"{self.rank}/{self.world_size}: resume with the same data.shard and world size")
        self.inner.load_state_dict(sd["inner"])


_END = object()


class PrefetchingLoader:
    """Prepares up to ``depth`` batches in a background thread (reading, tokenizing, packing overlap the step).

    Each prepared batch travels with a snapshot of the inner loader's state and stats taken right after it was
    made, so ``state_dict()`` is the state after the last batch handed out: resume stays exact. ``load_state_dict``
    is allowed before the first batch is taken (as when resuming)."""

    def __init__(self, inner, depth: int = 2):
        if depth < 1:
            raise ValueError(f"data.prefetch={depth}: expected an integer >= 1 (or 0 to disable prefetching)")
        self.inner, self.depth = inner, depth
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._snapshot()

    def _snapshot(self):
        self._state = copy.deepcopy(self.inner.state_dict())
        self._stats = copy.deepcopy(self.inner.stats)

    def _work(self):
        try:
            while not self._stop.is_set():
                batch = next(self.inner)
                item = (batch, copy.deepcopy(self.inner.state_dict()), copy.deepcopy(self.inner.stats))
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:  # noqa: BLE001 (surfaced in the consumer's next())
            self._queue.put((_END, exc, None))

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._thread is None:
            self._queue = queue.Queue(maxsize=self.depth)
            self._thread = threading.Thread(target=self._work, name="hilo-data-prefetch", daemon=True)
            self._thread.start()
        batch, state, stats = self._queue.get()
        if batch is _END:
            raise state
        self._state, self._stats = state, stats
        return batch

    @property
    def stats(self) -> dict:
        return self._stats

    def state_dict(self) -> dict:
        return copy.deepcopy(self._state)

    def load_state_dict(self, sd: Mapping) -> None:
        if self._thread is not None:
            raise RuntimeError("load_state_dict must be called before the first batch is taken")
        self.inner.load_state_dict(sd)
        self._snapshot()

    def load_global_state(self, sd: Mapping) -> None:
        """RowShardedLoader.load_global_state through the prefetcher (before the first batch)."""
        if not hasattr(self.inner, "load_global_state"):
            raise ValueError("only data.shard=rows reads one stream whatever the number of processes")
        if self._thread is not None:
            raise RuntimeError("load_global_state must be called before the first batch is taken")
        self.inner.load_global_state(sd)
        self._snapshot()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def pin(batch: dict) -> dict:
    """Page-locked copies, so host-to-GPU copies can overlap compute."""
    return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
