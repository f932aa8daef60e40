"""Damaged compressed files and over-long records: what the sources refuse, skip and count. (The errors are
data.sources.CorruptFileError, a ValueError.)"""
import io
import json
import logging

import pytest
import zstandard

from data.loader import TrainLoader
from data.sources import FilesSource, iter_file_records
from tests.data.helpers import ByteTokenizer, jsonl_lines, make_docs, write_jsonl

DOCS = make_docs("z", 114, max_len=300)


def multi_frame(docs, frames=4) -> tuple[bytes, list[int]]:
    """A .jsonl.zst payload of ``frames`` frames, and the byte offset where each frame starts (plus the end)."""
    lines = [line.encode() + b"\n" for line in jsonl_lines(docs)]
    per = -(-len(lines) // frames)
    c = zstandard.ZstdCompressor(level=3)
    parts = [c.compress(b"".join(lines[i:i + per])) for i in range(0, len(lines), per)]
    starts = [sum(len(p) for p in parts[:k]) for k in range(len(parts) + 1)]
    return b"".join(parts), starts


def multi_block(docs) -> bytes:
    """One zstd frame of many blocks (a flushed stream, as zstd writes large files)."""
    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=1).stream_writer(out, closefd=False) as w:
        for line in jsonl_lines(docs):
            w.write(line.encode() + b"\n")
            w.flush(zstandard.FLUSH_BLOCK)
    return out.getvalue()


def read_all(path, **kw):
    return list(iter_file_records(str(path), **kw))


def test_intact_multi_frame_and_multi_block_files_read_whole(tmp_path):
    payload, _ = multi_frame(DOCS)
    (tmp_path / "f.jsonl.zst").write_bytes(payload)
    (tmp_path / "b.jsonl.zst").write_bytes(multi_block(DOCS))
    assert read_all(tmp_path / "f.jsonl.zst") == DOCS
    assert read_all(tmp_path / "b.jsonl.zst") == DOCS


@pytest.mark.parametrize("kind", ["frames", "blocks"])
def test_truncated_zst_raises_naming_file_and_offset(tmp_path, kind):
    if kind == "frames":
        payload, starts = multi_frame(DOCS)
        # cuts inside a frame (a cut exactly at a frame boundary is a valid, shorter file)
        cuts = [5, starts[1] + 3, (starts[1] + starts[2]) // 2, starts[-1] - 1]
    else:
        payload = multi_block(DOCS)
        cuts = [5, 100, len(payload) // 2, len(payload) - 3]  # -3: only the end of the last block is missing
    for cut in cuts:
        path = tmp_path / f"cut{cut}.jsonl.zst"
        path.write_bytes(payload[:cut])
        got = []
        with pytest.raises(ValueError, match=rf"cut{cut}\.jsonl\.zst: truncated.*byte {cut}\b"):
            got.extend(iter_file_records(str(path)))
        # what came before the error is a clean prefix: no half record passed off as a malformed one
        assert got == DOCS[:len(got)], cut
        # a source stops too, instead of cycling over the prefix (or calling a small file "no records")
        with pytest.raises(ValueError, match="truncated"):
            source = FilesSource(str(path))
            for _ in range(2 * len(DOCS)):
                source.next_text()


def test_garbage_zst_raises_naming_file_and_offset(tmp_path):
    payload, starts = multi_frame(DOCS)
    cases = {"garbage.jsonl.zst": b"\x00not zstd at all\xff" * 40,
             "trailing.jsonl.zst": payload + b"junk after the last frame",
             "badframe.jsonl.zst": payload[:starts[2]] + b"\x13\x37" + payload[starts[2] + 2:]}
    offsets = {"garbage.jsonl.zst": 0, "trailing.jsonl.zst": starts[-1], "badframe.jsonl.zst": starts[2]}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=rf"{name}: corrupt zstd data in the frame starting at byte "
                                                   rf"{offsets[name]}\b"):
            read_all(tmp_path / name)


def test_on_corrupt_skip_skips_the_rest_warns_and_counts(tmp_path, caplog):
    good = write_jsonl(tmp_path / "a.jsonl.zst", jsonl_lines(DOCS[:10]), zst=True)
    payload, starts = multi_frame(DOCS[10:], frames=2)
    (tmp_path / "b.jsonl.zst").write_bytes(payload[:starts[1] + 20])
    readable = read_all(tmp_path / "b.jsonl.zst", on_corrupt="skip")
    assert readable[:-1] == DOCS[10:10 + len(readable) - 1] and len(readable) > 1
    source = FilesSource([str(good), str(tmp_path / "b.jsonl.zst")], on_corrupt="skip")
    with caplog.at_level(logging.WARNING, logger="data.sources"):
        first = [source.next_text() for _ in range(10 + len(readable) - 1)]
        assert source.epoch == 0
        source.next_text()  # the next epoch begins
    assert first == DOCS[:10] + readable[:-1]
    assert source.epoch == 1 and source.stats["corrupt_files"] == 1 and source.stats["malformed"] == 0
    warned = [r.getMessage() for r in caplog.records if "corrupt" in r.getMessage()]
    assert len(warned) == 1 and "b.jsonl.zst" in warned[0] and "truncated" in warned[0]


def test_on_corrupt_through_the_loader_config(tmp_path):
    payload, starts = multi_frame(DOCS, frames=2)
    (tmp_path / "b.jsonl.zst").write_bytes(payload[:starts[1] + 20])
    cfg = {"sources": [{"type": "files", "paths": [str(tmp_path / "b.jsonl.zst")]}], "on_corrupt": "skip"}
    loader = TrainLoader(cfg, ByteTokenizer(), seq_len=64, batch_size=4)
    for _ in range(40):
        next(loader)
    assert loader.stats["corrupt_files"] >= 1
    with pytest.raises(ValueError, match="truncated"):
        loader = TrainLoader({**cfg, "on_corrupt": "error"}, ByteTokenizer(), seq_len=64, batch_size=4)
        for _ in range(40):
            next(loader)
    with pytest.raises(ValueError, match="on_corrupt"):
        TrainLoader({**cfg, "on_corrupt": "ignore"}, ByteTokenizer(), seq_len=64, batch_size=4)


def long_file(tmp_path, name="long.jsonl"):
    docs = ["short", "L" * 23 + "M" * 7, "tiny", "x" * 10, "y" * 11]
    return write_jsonl(tmp_path / name, jsonl_lines(docs)), docs


def test_long_records_split_counted_and_warned_once_per_file(tmp_path, caplog):
    path, _ = long_file(tmp_path)
    source = FilesSource(str(path), max_document_chars=10)
    with caplog.at_level(logging.WARNING, logger="data.sources"):
        got = [source.next_text() for _ in range(9)]
    assert got == ["short", "L" * 10, "L" * 10, "LLLMMMMMMM", "tiny", "x" * 10, "y" * 10, "y", "short"]
    assert source.stats["long_documents"] == 2 and source.stats["docs"] == 9
    warned = [r.getMessage() for r in caplog.records if "max_document_chars" in r.getMessage()]
    assert len(warned) == 1 and "long.jsonl" in warned[0] and "30 characters" in warned[0]


def test_long_records_skipped_by_option(tmp_path):
    path, _ = long_file(tmp_path)
    source = FilesSource(str(path), max_document_chars=10, long_documents="skip")
    assert [source.next_text() for _ in range(4)] == ["short", "tiny", "x" * 10, "short"]
    assert source.stats["long_documents"] == 2


def test_resume_between_pieces_is_exact(tmp_path):
    path, _ = long_file(tmp_path)
    ref = FilesSource(str(path), max_document_chars=4)
    expected = [ref.next_text() for _ in range(30)]
    for k in range(1, 12):
        first = FilesSource(str(path), max_document_chars=4)
        head = [first.next_text() for _ in range(k)]
        second = FilesSource(str(path), max_document_chars=4)
        second.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert head + [second.next_text() for _ in range(30 - k)] == expected, k
        assert second.stats == ref.stats, k


def test_state_saved_without_the_new_counters_loads(tmp_path):
    path, _ = long_file(tmp_path)
    source = FilesSource(str(path), max_document_chars=10)
    sd = source.state_dict()
    del sd["remainder"]
    sd["stats"] = {k: v for k, v in sd["stats"].items() if k not in ("long_documents", "corrupt_files")}
    source.load_state_dict(sd)
    assert [source.next_text() for _ in range(2)] == ["short", "L" * 10]
    assert source.stats["long_documents"] == 1


def test_loader_cap_default_and_null(tmp_path):
    path, _ = long_file(tmp_path)
    cfg = {"sources": [{"type": "files", "paths": [str(path)]}]}
    assert TrainLoader(cfg, ByteTokenizer(), seq_len=8, batch_size=1).sources[0].max_document_chars == 10_000_000
    uncapped = TrainLoader({**cfg, "max_document_chars": None}, ByteTokenizer(), seq_len=8, batch_size=1)
    assert uncapped.sources[0].max_document_chars is None
    capped = TrainLoader({**cfg, "max_document_chars": 10}, ByteTokenizer(), seq_len=8, batch_size=1)
    for _ in range(12):
        next(capped)
    assert capped.stats["long_documents"] >= 2
    for bad in (0, -3, "10", True):
        with pytest.raises(ValueError, match="max_document_chars"):
            TrainLoader({**cfg, "max_document_chars": bad}, ByteTokenizer(), seq_len=8, batch_size=1)
