"""Document sources: local or remote files (one reader for every protocol) and streamed HF hub datasets.

A source yields documents (``str``) one at a time through ``next_text()`` and cycles forever (epochs);
``state_dict()`` taken between two calls records exactly where it stands, so a new source built with the same
arguments and given ``load_state_dict(sd)`` continues with the very next document.

Paths. ``files`` sources take local paths or globs, or any fsspec URL (``hf://datasets/<org>/<name>/<file>``
through huggingface_hub's HfFileSystem, ``s3://``, ``memory://``...): one code path opens them all, so
Long-Data-Collections' ``hf://datasets/togethercomputer/Long-Data-Collections/pretrain/*.jsonl.zst`` goes through
the same reader as the embedded corpus. Relative local paths are resolved against the repository root (the
directory that contains ``data/``), not the working directory, because Hydra changes the working directory.

Formats (by suffix): ``.jsonl``/``.json`` (one JSON object per line), the same with ``.zst`` (streamed zstd
decompression, multi-frame files included), ``.parquet`` (one row per record, read by row group), ``.txt``
(the whole file is one document). ``field`` names the JSON key / parquet column holding the text.

Malformed records (bad JSON or UTF-8, not an object, field missing or not a string) are skipped and counted in
``stats["malformed"]`` with a warning for the first few; empty texts are skipped and counted in
``stats["empty"]``. A truncated or corrupt ``.zst`` file raises CorruptFileError naming the file and the byte
offset of the damaged frame (``on_corrupt="skip"``: the rest of that file is skipped with a warning and counted
in ``stats["corrupt_files"]``). Records longer than ``max_document_chars`` are split or skipped and counted in
``stats["long_documents"]`` (see _Source; docs/robustness.md). A pass over the source (an epoch) that yields no document raises ``ValueError``, so a fully
malformed or empty source never spins forever or silently trains on nothing.

Per-rank sharding (every rank reads distinct data, no rank-0 dispatch): with at least ``world_size`` files,
files are assigned round-robin (file ``j`` goes to rank ``j % world_size``); otherwise every rank reads all
files and keeps record ``i`` (counted across files in order) when ``i % world_size == rank``. Hub datasets use
``datasets.distributed.split_dataset_by_node``, which follows the same two rules with the dataset's shards.

Network. A remote path or hub dataset that cannot be reached (no network, DNS, a proxy, HF_HUB_OFFLINE=1) raises
RemoteUnreachableError naming the path, with the way out: local copies in data.sources[*].paths / data.heldout,
made once with ``python -m data.preshard`` where the hub is reachable.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
MAX_WARNINGS = 5
_END = object()
_GLOB_CHARS = set("*?[")
ON_CORRUPT = ("error", "skip")
LONG_DOCUMENTS = ("split", "skip")
DEFAULT_MAX_DOCUMENT_CHARS = 10_000_000


class RemoteUnreachableError(ConnectionError):
    """A remote file or hub dataset could not be reached over the network (the message names it and the fix)."""


# httpx's transport errors (ConnectError, timeouts, proxy errors; huggingface_hub's HTTP client, whichever of
# httpx / httpx2 it ships) and requests' ConnectionError / Timeout, recognised by name so that no client is imported
_NETWORK_ERRORS = {"httpx": {"TransportError"}, "requests": {"ConnectionError", "Timeout"}}


def is_network_error(e: BaseException) -> bool:
    """True for an error that says the network (not the file) failed: connection, DNS, timeout, offline mode."""
    for err in (e, e.__cause__, e.__context__):
        if err is None:
            continue
        if isinstance(err, (ConnectionError, TimeoutError, socket.gaierror)):  # offline mode is a ConnectionError
            return True
        for cls in type(err).__mro__:
            package = cls.__module__.split(".")[0].rstrip("0123456789")  # httpx2 -> httpx
            if cls.__name__ in _NETWORK_ERRORS.get(package, ()):
                return True
    return False


def unreachable_message(what: str, e: BaseException, hub_name: str | None = None) -> str:
    """The message of a RemoteUnreachableError for `what` (a URL, or a hub dataset `hub_name`)."""
    host = "the Hugging Face hub" if hub_name is not None or what.startswith("hf://") else "the remote store"
    if hub_name is not None:
        preshard = f"python -m data.preshard --hub {hub_name} --out DIR --num-shards 64"
        local = "replace the hub source by a files source: data.sources=[{type: files, paths: [DIR/*.parquet]}]"
    else:
        preshard = f"python -m data.preshard --paths '{what}' --out DIR --num-shards 64"
        local = "point data.sources[*].paths (or data.heldout) at them: paths: [DIR/*.parquet]"
    return (f"cannot reach {host} for {what} ({type(e).__name__}: {e}); is this machine offline? Train on local "
            f"files instead: copy the data once where the network reaches it, or pre-shard it there into local "
            f"parquet files (`{preshard}`), then {local} (docs/configuration.md)")


@contextmanager
def named_network_errors(what: str, hub_name: str | None = None):
    """Turn a network error inside the block into RemoteUnreachableError naming `what` and the fix (a local path:
    nothing to turn)."""
    if hub_name is None and "://" not in what:
        yield
        return
    try:
        yield
    except RemoteUnreachableError:
        raise
    except Exception as e:
        if not is_network_error(e):
            raise
        raise RemoteUnreachableError(unreachable_message(what, e, hub_name)) from e


def _check_hub_online(url: str) -> None:
    """In huggingface_hub's offline mode an hf:// path cannot even be listed (its file system would report "no
    such file"): say so, with the way out."""
    from huggingface_hub import constants
    from huggingface_hub.errors import OfflineModeIsEnabled

    if constants.is_offline_mode():
        raise RemoteUnreachableError(unreachable_message(url, OfflineModeIsEnabled(
            "HF_HUB_OFFLINE is set: the hub is not contacted; unset it to stream the file")))


def resolve_path(path: str) -> str:
    """URLs (``proto://...``) unchanged; local paths made absolute, relative ones against the repository root."""
    path = str(path)
    if "://" in path:
        return path
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else REPO_ROOT / p)


def expand_paths(patterns: str | Sequence[str]) -> list[str]:
    """Resolve and glob ``patterns`` into a sorted, de-duplicated list of file paths/URLs.

    Raises FileNotFoundError naming the pattern when a glob matches nothing or a plain path does not exist, and
    RemoteUnreachableError when a remote one cannot be reached.
    """
    if isinstance(patterns, (str, Path)):
        patterns = [patterns]
    out: list[str] = []
    for pattern in patterns:
        url = resolve_path(pattern)
        local = "://" not in url
        if url.startswith("hf://"):
            _check_hub_online(url)
        with named_network_errors(url):
            fs, fs_path = fsspec.core.url_to_fs(url)
            if _GLOB_CHARS & set(fs_path):
                matches = sorted(m for m in fs.glob(fs_path) if fs.isfile(m))
            else:
                matches = [fs_path] if fs.isfile(fs_path) else []
        if not matches:
            hint = ("relative paths are resolved against the repository root " + str(REPO_ROOT) + "; "
                    "fix the path in the data config (data.sources[*].paths / data.heldout)"
                    if local else "check the URL and that the remote file exists (and that you are logged in)")
            corpus = " (the embedded corpus is rebuilt with `python data/build_corpus.py`)" if "corpus" in url else ""
            raise FileNotFoundError(f"no file matches {pattern!r} (resolved to {url}): {hint}{corpus}")
        out.extend(m if local else fs.unstrip_protocol(m) for m in matches)
    return sorted(dict.fromkeys(out))


def file_format(path: str) -> str:
    """The reader for ``path``: 'jsonl', 'jsonl.zst', 'parquet' or 'txt'."""
    name = path.rsplit("/", 1)[-1].lower()
    for suffix, fmt in ((".jsonl.zst", "jsonl.zst"), (".json.zst", "jsonl.zst"), (".jsonl", "jsonl"),
                        (".json", "jsonl"), (".parquet", "parquet"), (".txt", "txt")):
        if name.endswith(suffix):
            return fmt
    raise ValueError(f"unsupported file type {path!r}: expected .jsonl, .json, .jsonl.zst, .json.zst, .parquet "
                     f"or .txt")


class CorruptFileError(ValueError):
    """A data file that cannot be read to its end (truncated or corrupt compressed data)."""


class Corrupt:
    """The rest of a file could not be read (``data.on_corrupt=skip``); ``reason`` names the file and offset."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


class Malformed:
    """A record that could not be turned into text; ``reason`` says why."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


def _project(record: Any, field: str) -> str | Malformed:
    if not isinstance(record, Mapping):
        return Malformed(f"record is a {type(record).__name__}, not an object")
    if field not in record:
        return Malformed(f"field {field!r} missing (keys: {sorted(record)[:8]})")
    value = record[field]
    if not isinstance(value, str):
        return Malformed(f"field {field!r} is a {type(value).__name__}, not a string")
    return value


def _parse_json_line(line: bytes, field: str) -> str | Malformed:
    try:
        record = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return Malformed(f"bad JSON: {e}")
    return _project(record, field)


def _zstd_lines(f, path: str, chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
    """The lines (each with its b"\\n", the last one maybe without) of a zstd stream of frames back to back.

    Raises CorruptFileError naming ``path`` and the byte offset of the frame when the file ends inside a frame
    (a truncated download or copy) or holds bytes zstd cannot decode, after yielding the lines decoded before
    it. (zstandard's stream_reader ends silently at a truncation: the readable prefix looked like the file.)
    """
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    frame, frame_start, offset = None, 0, 0  # offset: bytes of the file consumed before `data`
    parts: list[bytes] = []
    while True:
        chunk = f.read(chunk_bytes)
        if not chunk:
            break
        data = chunk
        while data:
            if frame is None:
                frame, frame_start = dctx.decompressobj(), offset
            try:
                out = frame.decompress(data)
            except zstandard.ZstdError as e:
                raise CorruptFileError(f"{path}: corrupt zstd data in the frame starting at byte {frame_start} "
                                       f"(read up to byte {offset + len(data)}): {e}") from None
            if frame.eof:
                rest = frame.unused_data
                offset += len(data) - len(rest)
                data, frame = rest, None
            else:
                offset += len(data)
                data = b""
            if out:
                *complete, tail = out.split(b"\n")
                if complete:
                    complete[0] = b"".join(parts) + complete[0]
                    parts = []
                    for line in complete:
                        yield line + b"\n"
                if tail:
                    parts.append(tail)
    if frame is not None:
        raise CorruptFileError(f"{path}: truncated: the zstd frame starting at byte {frame_start} is cut off at "
                               f"the end of the file (byte {offset}); re-download or re-copy the file")
    if parts:
        yield b"".join(parts)


def iter_file_records(path: str, field: str = "text", start: int = 0,
                      wanted: Callable[[int], bool] | None = None,
                      on_corrupt: str = "error") -> Iterator[str | Malformed | Corrupt | None]:
    """Yield one item per record of ``path`` (text or Malformed), skipping the first ``start`` records.

    Record ``i`` is the i-th line of a jsonl file (blank lines included, they yield ""), the i-th row of a
    parquet file, or the whole file for .txt (record 0). Records for which ``wanted(i)`` is false yield None
    without being parsed (record-strided sharding: other ranks' records cost no JSON decoding).

    A truncated or undecodable .zst file raises CorruptFileError (file and byte offset) once its readable
    records are yielded; with ``on_corrupt="skip"`` it yields one Corrupt item instead and ends the file there.
    A remote file that cannot be reached (or whose stream breaks off) raises RemoteUnreachableError.
    """
    if on_corrupt not in ON_CORRUPT:
        raise ValueError(f"data.on_corrupt={on_corrupt!r}: expected one of {', '.join(ON_CORRUPT)}")
    fmt = file_format(path)
    with named_network_errors(path), fsspec.open(path, "rb") as f:
        if fmt == "txt":
            if start == 0:
                try:
                    yield f.read().decode("utf-8")
                except UnicodeDecodeError as e:
                    yield Malformed(f"not UTF-8: {e}")
            return
        if fmt == "parquet":
            yield from _iter_parquet(f, field, start)
            return
        lines = _zstd_lines(f, path) if fmt == "jsonl.zst" else f
        try:
            for i, line in enumerate(lines):
                if i < start:
                    continue
                if wanted is not None and not wanted(i):
                    yield None
                else:
                    yield _parse_json_line(line, field) if line.strip() else ""
        except CorruptFileError as e:
            if on_corrupt != "skip":
                raise
            yield Corrupt(str(e))


def _iter_parquet(f, field: str, start: int) -> Iterator[str | Malformed]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f)
    if field not in pf.schema_arrow.names:
        missing = Malformed(f"column {field!r} missing (columns: {pf.schema_arrow.names[:8]})")
        for _ in range(max(pf.metadata.num_rows - start, 0)):
            yield missing
        return
    # Skip whole row groups on resume instead of decoding them.
    first_group, skip = 0, start
    while first_group < pf.num_row_groups and skip >= pf.metadata.row_group(first_group).num_rows:
        skip -= pf.metadata.row_group(first_group).num_rows
        first_group += 1
    groups = list(range(first_group, pf.num_row_groups))
    if not groups:
        return
    for batch in pf.iter_batches(batch_size=256, columns=[field], row_groups=groups):
        for value in batch.column(0).to_pylist():
            if skip:
                skip -= 1
                continue
            yield value if isinstance(value, str) else Malformed(
                f"column {field!r} holds a {type(value).__name__}, not a string")


_STATS = {"docs": 0, "malformed": 0, "empty": 0, "long_documents": 0, "corrupt_files": 0, "epochs_completed": 0}


class _Source:
    """Shared bookkeeping: epochs, counters, warnings, the document-length cap and the no-document-in-an-epoch
    error.

    ``max_document_chars`` (None: no cap): a record longer than this is cut into pieces of at most that many
    characters, each a document of its own (``long_documents="split"``), or dropped (``"skip"``); either way it
    is counted in ``stats["long_documents"]`` and the first one of each file is warned about. The unread pieces
    of a split record are part of ``state_dict()``, so a resume between two pieces is exact.
    """

    def __init__(self, name: str, max_document_chars: int | None = None, long_documents: str = "split"):
        if max_document_chars is not None and (isinstance(max_document_chars, bool) or
                                               not isinstance(max_document_chars, int) or max_document_chars < 1):
            raise ValueError(f"data.max_document_chars={max_document_chars!r}: expected a positive integer or null "
                             f"(no cap)")
        if long_documents not in LONG_DOCUMENTS:
            raise ValueError(f"data.long_documents={long_documents!r}: expected one of {', '.join(LONG_DOCUMENTS)}")
        self.name = name
        self.max_document_chars, self.long_documents = max_document_chars, long_documents
        self.epoch = 0
        self.stats = dict(_STATS)
        self._epoch_docs = 0
        self._epoch_records = 0
        self._first_error: str | None = None
        self._remainder = ""  # the pieces of a split record not yet returned
        self._long_warned: set[str] = set()

    def _next_piece(self) -> str | None:
        """The next piece of a split record, or None when there is none."""
        if not self._remainder:
            return None
        cap = self.max_document_chars
        piece, self._remainder = self._remainder[:cap], self._remainder[cap:]
        self.stats["docs"] += 1
        self._epoch_docs += 1
        return piece

    def _accept(self, item: str | Malformed, where: str | None = None) -> str | None:
        self._epoch_records += 1
        if isinstance(item, Malformed):
            self.stats["malformed"] += 1
            self._first_error = self._first_error or item.reason
            if self.stats["malformed"] <= MAX_WARNINGS:
                log.warning("source %s: skipping malformed record (%s)%s", self.name, item.reason,
                            "; further ones are only counted" if self.stats["malformed"] == MAX_WARNINGS else "")
            return None
        if not item:
            self.stats["empty"] += 1
            return None
        cap = self.max_document_chars
        if cap is not None and len(item) > cap:
            self.stats["long_documents"] += 1
            where = where or self.name
            if where not in self._long_warned:
                self._long_warned.add(where)
                pieces = -(-len(item) // cap)
                log.warning("source %s: a record of %d characters in %s exceeds data.max_document_chars=%d; %s "
                            "(further ones in this file are only counted in stats['long_documents'])", self.name,
                            len(item), where, cap, f"split into {pieces} documents" if self.long_documents ==
                            "split" else "skipped (data.long_documents=skip)")
            if self.long_documents == "skip":
                return None
            item, self._remainder = item[:cap], item[cap:]
        self.stats["docs"] += 1
        self._epoch_docs += 1
        return item

    def _end_epoch(self, where: str) -> None:
        if self._epoch_docs == 0:
            if self._epoch_records == 0:
                raise ValueError(f"source {self.name}: {where} yielded no records; a rank needs at least one "
                                 f"document (check the paths, the split, or use fewer ranks than records)")
            raise ValueError(f"source {self.name}: all {self._epoch_records} records {where} were malformed or "
                             f"empty (first error: {self._first_error or 'empty text'}); check `field`")
        self.epoch += 1
        self.stats["epochs_completed"] += 1
        self._epoch_docs = self._epoch_records = 0

    def _base_state(self) -> dict:
        return {"epoch": self.epoch, "stats": dict(self.stats), "epoch_docs": self._epoch_docs,
                "epoch_records": self._epoch_records, "remainder": self._remainder}

    def _load_base_state(self, sd: Mapping) -> None:
        self.epoch = int(sd["epoch"])
        self.stats = {**_STATS, **sd["stats"]}  # states saved before a counter existed start it at 0
        self._remainder = sd.get("remainder", "")
        self._epoch_docs = int(sd["epoch_docs"])
        self._epoch_records = int(sd["epoch_records"])


class FilesSource(_Source):
    """Documents from local files or fsspec URLs; see the module docstring for formats and sharding.

    State: epoch, index of the current file in this rank's list, index of the next record in that file, and
    the global record counter used for record-strided sharding. Resuming reopens the current file and skips
    records: parquet skips whole row groups, but a jsonl(.zst) file is read (not parsed) up to the position
    again, which for a multi-GB remote file means streaming it again; pre-shard such files (data.preshard).
    """

    def __init__(self, paths: str | Sequence[str], field: str = "text", rank: int = 0, world_size: int = 1,
                 name: str | None = None, on_corrupt: str = "error", max_document_chars: int | None = None,
                 long_documents: str = "split"):
        files = expand_paths(paths)
        super().__init__(name or (files[0] if len(files) == 1 else f"{files[0]} (+{len(files) - 1} files)"),
                         max_document_chars, long_documents)
        if on_corrupt not in ON_CORRUPT:
            raise ValueError(f"data.on_corrupt={on_corrupt!r}: expected one of {', '.join(ON_CORRUPT)}")
        self.on_corrupt = on_corrupt
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        self.files, self.field, self.rank, self.world_size = files, field, rank, world_size
        by_file = len(files) >= world_size
        self.my_files = files[rank::world_size] if by_file else files
        self.record_stride = 1 if by_file else world_size
        self.sharding = "files" if by_file else "records"
        self.file_idx = 0
        self.record_idx = 0
        self.global_idx = 0
        self._records: Iterator[str | Malformed] | None = None

    def next_text(self) -> str:
        """The next document of this rank (cycling through epochs)."""
        piece = self._next_piece()
        if piece is not None:
            return piece
        while True:
            if self._records is None:
                # record i of this file has global index global_idx - record_idx + i
                base = self.global_idx - self.record_idx
                wanted = None if self.record_stride == 1 else (
                    lambda i, base=base: (base + i) % self.record_stride == self.rank)
                self._records = iter_file_records(self.my_files[self.file_idx], self.field, self.record_idx,
                                                  wanted, on_corrupt=self.on_corrupt)
            item = next(self._records, _END)
            if isinstance(item, Corrupt):  # the file ends here (data.on_corrupt=skip); the next item is _END
                self.stats["corrupt_files"] += 1
                log.warning("source %s: skipping the rest of a corrupt file after %d records (data.on_corrupt="
                            "skip; counted in stats['corrupt_files']): %s", self.name, self.record_idx, item.reason)
                continue
            if item is _END:
                self._records = None
                self.file_idx += 1
                self.record_idx = 0
                if self.file_idx == len(self.my_files):
                    self._end_epoch(f"in {len(self.my_files)} file(s) for rank {self.rank}/{self.world_size}")
                    self.file_idx = self.global_idx = 0
                continue
            mine = self.global_idx % self.record_stride == self.rank % self.record_stride
            self.record_idx += 1
            self.global_idx += 1
            if mine:
                text = self._accept(item, self.my_files[self.file_idx])
                if text is not None:
                    return text

    def state_dict(self) -> dict:
        return {"type": "files", "files": list(self.files), "rank": self.rank, "world_size": self.world_size,
                "file_idx": self.file_idx, "record_idx": self.record_idx, "global_idx": self.global_idx,
                **self._base_state()}

    def load_state_dict(self, sd: Mapping) -> None:
        if list(sd["files"]) != self.files:
            raise ValueError(f"source {self.name}: the saved state was taken over a different file list "
                             f"({len(sd['files'])} files, first {sd['files'][:1]}); resume needs the same files")
        if (sd["rank"], sd["world_size"]) != (self.rank, self.world_size):
            raise ValueError(f"source {self.name}: state saved by rank {sd['rank']}/{sd['world_size']} cannot "
                             f"resume rank {self.rank}/{self.world_size} exactly")
        self._load_base_state(sd)
        self.file_idx, self.record_idx, self.global_idx = int(sd["file_idx"]), int(sd["record_idx"]), int(
            sd["global_idx"])
        self._records = None


class HubSource(_Source):
    """Documents streamed from a HF dataset: ``datasets.load_dataset(name, config, split=..., streaming=True)``.

    Split per rank with ``split_dataset_by_node``; resume through the IterableDataset's own
    ``state_dict()``/``load_state_dict()`` (exact as long as no shuffle buffer is used, which is why this source
    does not shuffle). ``data_files`` and ``load_kwargs`` are passed to load_dataset (e.g. name="json" with
    local data_files).
    """

    def __init__(self, name: str, config: str | None = None, split: str = "train", field: str = "text",
                 data_files: Any = None, rank: int = 0, world_size: int = 1,
                 load_kwargs: Mapping | None = None, max_document_chars: int | None = None,
                 long_documents: str = "split"):
        import datasets
        from datasets.distributed import split_dataset_by_node

        super().__init__(f"hub:{name}" + (f"/{config}" if config else "") + f"[{split}]", max_document_chars,
                         long_documents)
        kwargs = dict(load_kwargs or {})
        if data_files is not None:
            kwargs["data_files"] = _plain(data_files)
        self.hub_name = name
        with named_network_errors(f"the hub dataset {name!r}", hub_name=name):
            ds = datasets.load_dataset(name, config, split=split, streaming=True, **kwargs)
        if world_size > 1:
            ds = split_dataset_by_node(ds, rank=rank, world_size=world_size)
        self.dataset, self.field, self.rank, self.world_size = ds, field, rank, world_size
        self._initial_state = ds.state_dict()
        self._resume_state: dict | None = None
        self._examples: Iterator | None = None

    def next_text(self) -> str:
        piece = self._next_piece()
        if piece is not None:
            return piece
        while True:
            if self._examples is None:
                self.dataset.load_state_dict(self._resume_state or self._initial_state)
                self.dataset.set_epoch(self.epoch)
                self._resume_state = None
                self._examples = iter(self.dataset)
            with named_network_errors(f"the hub dataset {self.hub_name!r}", hub_name=self.hub_name):
                example = next(self._examples, None)
            if example is None:
                self._examples = None
                self._end_epoch(f"in {self.name} for rank {self.rank}/{self.world_size}")
                continue
            text = self._accept(_project(example, self.field))
            if text is not None:
                return text

    def state_dict(self) -> dict:
        if self._examples is not None:
            dataset_state = self.dataset.state_dict()
        else:  # between epochs or just resumed: where the next iteration will start
            dataset_state = self._resume_state or self._initial_state
        return {"type": "hub", "rank": self.rank, "world_size": self.world_size,
                "dataset": _plain(dataset_state), **self._base_state()}

    def load_state_dict(self, sd: Mapping) -> None:
        if (sd["rank"], sd["world_size"]) != (self.rank, self.world_size):
            raise ValueError(f"source {self.name}: state saved by rank {sd['rank']}/{sd['world_size']} cannot "
                             f"resume rank {self.rank}/{self.world_size} exactly")
        self._load_base_state(sd)
        self._resume_state = _plain(sd["dataset"])
        self._examples = None


def _plain(obj: Any) -> Any:
    """Deep-copy mappings/sequences (OmegaConf containers included) into plain dicts/lists."""
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) or (isinstance(obj, Sequence) and not isinstance(obj, (str, bytes))):
        return [_plain(v) for v in obj]
    return obj


SOURCE_TYPES = ("files", "hub")


def build_source(cfg: Mapping, rank: int = 0, world_size: int = 1, *, on_corrupt: str = "error",
                 max_document_chars: int | None = None, long_documents: str = "split"):
    """Build one source from its config entry ({type: files, paths, field} or {type: hub, name, config, split,
    field, data_files, load_kwargs}); ``weight`` is read by the loader, not here. The keyword options are the
    data config's on_corrupt (files only), max_document_chars and long_documents (see _Source)."""
    cfg = _plain(cfg)
    kind = cfg.get("type", "files")
    field = cfg.get("field", "text")
    if kind == "files":
        if not cfg.get("paths"):
            raise ValueError(f"files source needs `paths` (a path, glob or list of them): {cfg}")
        return FilesSource(cfg["paths"], field=field, rank=rank, world_size=world_size, name=cfg.get("name"),
                           on_corrupt=on_corrupt, max_document_chars=max_document_chars,
                           long_documents=long_documents)
    if kind == "hub":
        if not cfg.get("name"):
            raise ValueError(f"hub source needs `name` (a HF dataset id or builder such as 'json'): {cfg}")
        return HubSource(cfg["name"], cfg.get("config"), split=cfg.get("split", "train"), field=field,
                         data_files=cfg.get("data_files"), rank=rank, world_size=world_size,
                         load_kwargs=cfg.get("load_kwargs"), max_document_chars=max_document_chars,
                         long_documents=long_documents)
    raise ValueError(f"unknown source type {kind!r}; valid types: {', '.join(SOURCE_TYPES)}")
