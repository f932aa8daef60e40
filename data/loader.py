"""The training loader (sources -> tokenizer -> packing) and the held-out document reader.

Data config (conf/data/*.yaml)::

    sources:                     # one or more, mixed by probability
      - {type: files, paths: [data/corpus/train-*.jsonl.zst], field: text, weight: 1.0}
      - {type: hub, name: HuggingFaceFW/fineweb-edu, config: sample-10BT, split: train, field: text, weight: 0.5}
    heldout: data/corpus/heldout.jsonl.zst    # path/glob/list, or a source dict ({type: files|hub, ...})
    packing: fixed                            # or varlen
    on_corrupt: error                         # or skip: the rest of a truncated/corrupt .zst file (counted)
    max_document_chars: 10000000              # longer training records are split (or skipped); null: no cap
    long_documents: split                     # or skip
    retrieval_mix: {fraction: 0.0, tasks: [...]}   # needle documents in place of rows (data.retrieval_mix)

Relative local paths are resolved against the repository root (see data.sources).

``build_train_loader`` returns a ``TrainLoader``: an endless iterator of batches (CPU LongTensors, layouts in
data.packing). With ``retrieval_mix`` on, a row may be replaced by a needle-in-a-haystack document
(data.retrieval_mix), decided from the seed, the rank and the row's index. For every new document it draws a source with probability proportional to its weight from a
numpy Generator seeded with (seed, rank); sources restart (next epoch) when exhausted. The loader reads
synchronously in the calling process, so ``state_dict()`` between two batches is exact: source positions,
the leftover token buffer, the RNG state and the counters. A new loader built with the same arguments and
given ``load_state_dict(sd)`` yields exactly the batches the old one would have yielded next. The state holds
only lists, dicts, ints, floats, bools and strings (JSON- and torch.save-serialisable). Each rank has its own
state: save one per rank.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from .packing import PACKERS, TokenBuffer, ignore_row_tails
from .prefetch import PrefetchingLoader, RowShardedLoader
from .retrieval_mix import build_retrieval_mix
from .sources import (
    DEFAULT_MAX_DOCUMENT_CHARS,
    MAX_WARNINGS,
    HubSource,
    Malformed,
    _plain,
    build_source,
    expand_paths,
    iter_file_records,
)

log = logging.getLogger(__name__)
STATE_VERSION = 1


class TrainLoader:
    """Endless, resumable iterator of packed training batches for one rank; see the module docstring."""

    def __init__(self, data_cfg: Mapping, tokenizer, *, seq_len: int, batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0):
        cfg = _plain(data_cfg)
        self.packing = cfg.get("packing", "fixed")
        if self.packing not in PACKERS:
            raise ValueError(f"unknown data.packing {self.packing!r}; valid: {', '.join(PACKERS)}")
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be positive")
        source_cfgs = cfg.get("sources")
        if not source_cfgs:
            raise ValueError("data config has no `sources`: give at least one {type: files|hub, ...}")
        weights = [float(s.get("weight", 1.0)) for s in source_cfgs]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"source weights must be >= 0 with a positive sum, got {weights}")
        options = {"on_corrupt": cfg.get("on_corrupt", "error"),
                   "max_document_chars": cfg.get("max_document_chars", DEFAULT_MAX_DOCUMENT_CHARS),
                   "long_documents": cfg.get("long_documents", "split")}
        self.sources = [build_source(s, rank=rank, world_size=world_size, **options) for s in source_cfgs]
        self.probabilities = [w / sum(weights) for w in weights]
        self._cumulative = np.cumsum(self.probabilities).tolist()
        self.tokenizer, self.eos_id = tokenizer, int(tokenizer.eos_id)
        self.seq_len, self.batch_size, self.rank, self.world_size, self.seed = (
            seq_len, batch_size, rank, world_size, seed)
        self.rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, rank])))
        self.buffer = TokenBuffer()
        self.retrieval_mix = build_retrieval_mix(cfg.get("retrieval_mix"), tokenizer, seq_len=seq_len, seed=seed,
                                                 rank=rank)
        # rows: the index of the next row (what the retrieval mix keys on, so any batch size continues the count)
        self.counters = {"batches": 0, "tokens": 0, "tokens_read": 0, "rows": 0, "retrieval_rows": 0}

    def __iter__(self) -> Iterator[dict]:
        return self

    def _next_document(self) -> list[int]:
        u = self.rng.random()
        k = min(bisect.bisect_right(self._cumulative, u), len(self.sources) - 1)
        while self.probabilities[k] == 0:  # float round-off at the top of the cumulative sum
            k -= 1
        tokens = self.tokenizer.encode(self.sources[k].next_text())
        tokens.append(self.eos_id)
        return tokens

    def __next__(self) -> dict:
        need = self.seq_len * self.batch_size
        while self.buffer.num_tokens < need:
            tokens = self._next_document()
            self.counters["tokens_read"] += len(tokens)
            self.buffer.push_document(tokens)
        rows = [self.buffer.take(self.seq_len) for _ in range(self.batch_size)]
        needle_ends = {}
        if self.retrieval_mix is not None:
            for i, row in enumerate(rows):
                needle = self.retrieval_mix.replace(self.counters["rows"] + i, row)
                if needle is not None:
                    rows[i], needle_ends[i] = needle
        self.counters["batches"] += 1
        self.counters["tokens"] += need
        self.counters["rows"] += self.batch_size
        self.counters["retrieval_rows"] += len(needle_ends)
        batch = PACKERS[self.packing](rows)
        ignore_row_tails(batch, needle_ends, self.seq_len)
        return batch

    @property
    def stats(self) -> dict:
        """Counters: docs, malformed, empty, long_documents, corrupt_files (summed over sources), tokens emitted,
        tokens_read, batches, rows, retrieval_rows (needle documents), buffered tokens, and per-source docs/malformed/empty/long_documents/corrupt_files/
        epochs_completed."""
        per_source = [{"name": s.name, **s.stats} for s in self.sources]
        total = lambda key: sum(s[key] for s in per_source)
        return {"docs": total("docs"), "malformed": total("malformed"), "empty": total("empty"),
                "long_documents": total("long_documents"), "corrupt_files": total("corrupt_files"),
                **self.counters, "buffered_tokens": self.buffer.num_tokens, "sources": per_source}

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "rank": self.rank, "world_size": self.world_size,
                "sources": [s.state_dict() for s in self.sources], "buffer": self.buffer.state_dict(),
                "rng": _plain(self.rng.bit_generator.state), "counters": dict(self.counters)}

    def load_state_dict(self, sd: Mapping) -> None:
        if sd.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {sd.get('version')} != {STATE_VERSION}")
        if (sd["rank"], sd["world_size"]) != (self.rank, self.world_size):
            raise ValueError(f"loader state of rank {sd['rank']}/{sd['world_size']} given to rank "
                             f"{self.rank}/{self.world_size}: resume with the same world size and each rank's "
                             f"own state")
        if len(sd["sources"]) != len(self.sources):
            raise ValueError(f"loader state has {len(sd['sources'])} sources, config has {len(self.sources)}")
        for source, source_sd in zip(self.sources, sd["sources"]):
            source.load_state_dict(source_sd)
        self.buffer.load_state_dict(sd["buffer"])
        self.rng.bit_generator.state = _plain(sd["rng"])
        # a state saved before rows were counted: every batch had this loader's batch size
        self.counters = {"rows": sd["counters"]["batches"] * self.batch_size, "retrieval_rows": 0,
                         **sd["counters"]}


def build_train_loader(data_cfg: Mapping, tokenizer, *, seq_len: int, batch_size: int, rank: int = 0,
                       world_size: int = 1, seed: int = 0):
    """The training loader for ``rank`` of ``world_size``.

    Fixed packing yields {"input_ids", "labels"} [batch_size, seq_len]; varlen packing yields
    {"input_ids", "labels", "position_ids"} [1, batch_size*seq_len] and "cu_seqlens" [N+1].

    data_cfg["shard"]: "documents" (default; each rank reads a distinct shard of every source) or "rows" (every
    rank reads the whole stream and keeps its rows of each global batch: the same global batches for any number
    of processes). data_cfg["prefetch"]: batches prepared ahead in a background thread (default 2; 0: none).
    Every variant has exact state_dict()/load_state_dict() and .stats.

    data_cfg["type"] == "mqar" (conf/data/mqar.yaml) builds the synthetic MQAR loader instead (data.mqar.MQARLoader:
    same interface, {"input_ids", "labels"} [batch_size, T] with T set by each batch's setting; tokenizer and
    seq_len unused).
    """
    cfg = _plain(data_cfg)
    if cfg.get("type") == "mqar":
        from .mqar import MQARLoader

        return MQARLoader(cfg, batch_size=batch_size, rank=rank, world_size=world_size, seed=seed)
    shard = cfg.get("shard", "documents")
    if shard == "documents":
        loader = TrainLoader(cfg, tokenizer, seq_len=seq_len, batch_size=batch_size, rank=rank,
                             world_size=world_size, seed=seed)
    elif shard == "rows":
        global_loader = TrainLoader(cfg, tokenizer, seq_len=seq_len, batch_size=batch_size * world_size, rank=0,
                                    world_size=1, seed=seed)
        loader = RowShardedLoader(global_loader, rank=rank, world_size=world_size, batch_size=batch_size,
                                  seq_len=seq_len)
    else:
        raise ValueError(f"data.shard={shard!r}: expected documents or rows")
    depth = cfg.get("prefetch", 2)
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
        raise ValueError(f"data.prefetch={depth!r}: expected an integer >= 0 (0 disables prefetching)")
    return PrefetchingLoader(loader, depth) if depth else loader


def _iter_heldout_texts(heldout: Any) -> Iterator[str | Malformed]:
    if isinstance(heldout, Mapping) and heldout.get("type", "files") == "hub":
        source = build_source(heldout)
        assert isinstance(source, HubSource)
        for example in source.dataset:
            value = example.get(source.field) if isinstance(example, Mapping) else None
            yield value if isinstance(value, str) else Malformed(f"field {source.field!r} missing or not a string")
        return
    paths, field = (heldout.get("paths"), heldout.get("field", "text")) if isinstance(heldout, Mapping) else (
        heldout, "text")
    for path in expand_paths(paths):
        yield from iter_file_records(path, field)


def iter_heldout_documents(data_cfg: Mapping, tokenizer, min_tokens: int = 0,
                           max_docs: int | None = None) -> Iterator[list[int]]:
    """Token ids of the held-out documents (``data_cfg["heldout"]``), one list per document, in file order.

    Only documents with at least ``min_tokens`` tokens are yielded, at most ``max_docs`` of them (None: all).
    Ids are the document's tokens alone: no BOS/EOS added, nothing packed together. Malformed records are
    skipped with a warning. Raises ValueError when no document qualifies (so an evaluation never silently
    averages over nothing).
    """
    heldout = _plain(data_cfg).get("heldout")
    if not heldout:
        raise ValueError("data config has no `heldout` (a path/glob/list or a source dict)")
    yielded = seen = malformed = longest = 0
    for item in _iter_heldout_texts(heldout):
        if max_docs is not None and yielded >= max_docs:
            return
        if isinstance(item, Malformed):
            malformed += 1
            if malformed <= MAX_WARNINGS:
                log.warning("held-out: skipping malformed record (%s)", item.reason)
            continue
        seen += 1
        tokens = tokenizer.encode(item)
        longest = max(longest, len(tokens))
        if len(tokens) >= min_tokens:
            yielded += 1
            yield tokens
    if yielded == 0:
        raise ValueError(f"no held-out document in {heldout!r} has >= {min_tokens} tokens ({seen} documents, "
                         f"longest {longest} tokens, {malformed} malformed records)")
