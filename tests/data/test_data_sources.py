import json
import logging

import fsspec
import pytest

from data.sources import FilesSource, HubSource, build_source, expand_paths, iter_file_records
from tests.data.helpers import jsonl_lines, make_docs, write_jsonl, write_parquet


def one_epoch(source) -> list[str]:
    """All documents of the source's current epoch (stops at the epoch boundary)."""
    out, epoch = [], source.epoch
    while True:
        text = source.next_text()
        if source.epoch != epoch:
            return out
        out.append(text)


def test_formats_read_identically(tmp_path):
    docs = make_docs("f", 23) + ["unicode: é ✓ 日本語\nsecond line"]
    write_jsonl(tmp_path / "a.jsonl", jsonl_lines(docs))
    write_jsonl(tmp_path / "a.jsonl.zst", jsonl_lines(docs), zst=True, frames=3)
    write_parquet(tmp_path / "a.parquet", docs, row_group_size=5)
    for name in ("a.jsonl", "a.jsonl.zst", "a.parquet"):
        assert list(iter_file_records(str(tmp_path / name))) == docs, name
    (tmp_path / "b.txt").write_text(docs[-1])
    assert list(iter_file_records(str(tmp_path / "b.txt"))) == [docs[-1]]


def test_resume_offsets_in_every_format(tmp_path):
    docs = make_docs("r", 17)
    write_jsonl(tmp_path / "a.jsonl.zst", jsonl_lines(docs), zst=True)
    write_parquet(tmp_path / "a.parquet", docs, row_group_size=4)
    for name in ("a.jsonl.zst", "a.parquet"):
        for start in (0, 3, 4, 8, 16, 17, 20):
            assert list(iter_file_records(str(tmp_path / name), start=start)) == docs[start:], (name, start)


def test_field_projection(tmp_path):
    lines = [json.dumps({"content": f"c{i}", "text": f"t{i}"}) for i in range(5)]
    write_jsonl(tmp_path / "a.jsonl", lines)
    write_parquet(tmp_path / "a.parquet", [f"c{i}" for i in range(5)], field="content")
    assert one_epoch(FilesSource(str(tmp_path / "a.jsonl"), field="content")) == [f"c{i}" for i in range(5)]
    assert one_epoch(FilesSource(str(tmp_path / "a.parquet"), field="content")) == [f"c{i}" for i in range(5)]


def test_fsspec_urls_use_the_same_reader(tmp_path):
    # hf:// URLs go through fsspec exactly like this in-memory filesystem (no network in tests).
    docs = make_docs("m", 9)
    write_jsonl(tmp_path / "x.jsonl.zst", jsonl_lines(docs), zst=True)
    with fsspec.open("memory://corpus/part-0.jsonl.zst", "wb") as f:
        f.write((tmp_path / "x.jsonl.zst").read_bytes())
    files = expand_paths("memory://corpus/*.jsonl.zst")
    assert len(files) == 1 and files[0].startswith("memory://") and files[0].endswith("corpus/part-0.jsonl.zst")
    assert one_epoch(FilesSource("memory://corpus/*.jsonl.zst")) == docs


def test_malformed_records_skipped_counted_and_warned(tmp_path, caplog):
    good = make_docs("g", 6)
    lines = jsonl_lines(good[:2]) + ["{not json", json.dumps({"other": 1}), json.dumps({"text": 5}),
                                     json.dumps([1, 2]), "", json.dumps({"text": ""})] + jsonl_lines(good[2:])
    lines += ["{bad"] * 6
    write_jsonl(tmp_path / "a.jsonl", lines)
    src = FilesSource(str(tmp_path / "a.jsonl"))
    with caplog.at_level(logging.WARNING, logger="data.sources"):
        assert one_epoch(src) == good
    # one_epoch also read the first document of the second epoch
    assert src.stats["malformed"] == 10 and src.stats["empty"] == 2 and src.stats["docs"] == 7
    warnings = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(warnings) == 5  # only the first few are logged
    assert src.stats["epochs_completed"] == 1


def test_all_malformed_source_raises(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["{bad", json.dumps({"body": "x"}), json.dumps({"body": "y"})])
    with pytest.raises(ValueError, match="all 3 records.*malformed"):
        FilesSource(str(tmp_path / "a.jsonl")).next_text()
    write_parquet(tmp_path / "b.parquet", ["x", "y"], field="body")
    with pytest.raises(ValueError, match="column 'text' missing"):
        FilesSource(str(tmp_path / "b.parquet")).next_text()
    write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(ValueError, match="no records"):
        FilesSource(str(tmp_path / "empty.jsonl")).next_text()


def test_missing_path_error_names_path_and_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl.*resolved to.*fix the path"):
        FilesSource(str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"missing_dir/\*\.jsonl"):
        expand_paths(str(tmp_path / "missing_dir" / "*.jsonl"))
    with pytest.raises(ValueError, match="unknown source type 'ftp'"):
        build_source({"type": "ftp", "paths": ["x"]})


def test_relative_paths_resolve_against_repo_root(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # as under Hydra: the working directory is not the repo
    files = expand_paths("data/corpus/train-*.jsonl.zst")
    assert len(files) == 4 and all(f.endswith(f"train-0000{k}.jsonl.zst") for k, f in enumerate(files))


@pytest.mark.parametrize("num_files,world_size", [(4, 2), (5, 2), (3, 3), (1, 3), (2, 3)])
def test_rank_shards_are_disjoint_and_cover_everything(tmp_path, num_files, world_size):
    all_docs = []
    for k in range(num_files):
        docs = make_docs(f"s{k}_", 7 + k)
        all_docs += docs
        write_jsonl(tmp_path / f"p{k}.jsonl.zst", jsonl_lines(docs), zst=True)
    per_rank = [one_epoch(FilesSource(str(tmp_path / "*.jsonl.zst"), rank=r, world_size=world_size))
                for r in range(world_size)]
    seen = [d for docs in per_rank for d in docs]
    assert sorted(seen) == sorted(all_docs) and len(set(seen)) == len(seen)
    assert all(per_rank)
    if num_files < world_size:  # record striding: document i of the concatenation goes to rank i % W
        assert per_rank[1] == all_docs[1::world_size]


def test_files_source_resume_and_epochs(tmp_path):
    for k in range(3):
        write_jsonl(tmp_path / f"p{k}.jsonl", jsonl_lines(make_docs(f"e{k}_", 5)) + ["{bad"])
    for world_size, rank in ((1, 0), (2, 1), (4, 3)):
        ref = FilesSource(str(tmp_path / "*.jsonl"), rank=rank, world_size=world_size)
        expected = [ref.next_text() for _ in range(40)]  # several epochs
        for cut in (0, 1, 4, 9, 17):
            a = FilesSource(str(tmp_path / "*.jsonl"), rank=rank, world_size=world_size)
            got = [a.next_text() for _ in range(cut)]
            sd = json.loads(json.dumps(a.state_dict()))
            b = FilesSource(str(tmp_path / "*.jsonl"), rank=rank, world_size=world_size)
            b.load_state_dict(sd)
            got += [b.next_text() for _ in range(40 - cut)]
            assert got == expected, (world_size, rank, cut)
        assert ref.stats["epochs_completed"] >= 2
    wrong_rank = FilesSource(str(tmp_path / "*.jsonl"), rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank 1/2 cannot resume rank 0/2"):
        wrong_rank.load_state_dict(FilesSource(str(tmp_path / "*.jsonl"), rank=1, world_size=2).state_dict())


def hub_cfg(tmp_path, num_files=3, per_file=6):
    files = []
    for k in range(num_files):
        path = tmp_path / f"h{k}.jsonl"
        write_jsonl(path, jsonl_lines(make_docs(f"h{k}_", per_file)) + [json.dumps({"text": None})])
        files.append(str(path))
    return {"type": "hub", "name": "json", "split": "train", "field": "text", "data_files": files}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_hub_source_split_by_node_and_resume(tmp_path, world_size):
    cfg = hub_cfg(tmp_path)
    all_docs = [d for k in range(3) for d in make_docs(f"h{k}_", 6)]
    sources = [build_source(cfg, rank=r, world_size=world_size) for r in range(world_size)]
    per_rank = [one_epoch(s) for s in sources]
    seen = [d for docs in per_rank for d in docs]
    assert sorted(seen) == sorted(all_docs) and len(set(seen)) == len(seen)
    assert sum(s.stats["malformed"] for s in sources) == 3  # one {"text": null} per file
    rank = world_size - 1
    ref = build_source(cfg, rank=rank, world_size=world_size)
    assert isinstance(ref, HubSource)
    total = 2 * len(per_rank[rank]) + 3  # crosses two epoch boundaries
    expected = [ref.next_text() for _ in range(total)]
    assert expected[: len(per_rank[rank])] == per_rank[rank]
    for cut in (0, 2, len(per_rank[rank]), len(per_rank[rank]) + 1):
        a = build_source(cfg, rank=rank, world_size=world_size)
        got = [a.next_text() for _ in range(cut)]
        sd = json.loads(json.dumps(a.state_dict()))
        b = build_source(cfg, rank=rank, world_size=world_size)
        b.load_state_dict(sd)
        got += [b.next_text() for _ in range(total - cut)]
        assert got == expected, cut


def test_hub_source_all_malformed_raises(tmp_path):
    write_jsonl(tmp_path / "bad.jsonl", [json.dumps({"body": "x"})] * 3)
    src = build_source({"type": "hub", "name": "json", "data_files": [str(tmp_path / "bad.jsonl")], "field": "text"})
    with pytest.raises(ValueError, match="malformed"):
        src.next_text()


LDC_FILE = "hf://datasets/togethercomputer/Long-Data-Collections/pretrain/rp_sub.jsonl.zst"


@pytest.fixture
def no_network(monkeypatch):
    """Every DNS lookup fails, as on a machine without network: nothing reaches the internet. huggingface_hub's
    offline mode (set for the tests) is lifted, so its client really tries."""
    import socket

    from huggingface_hub import constants

    def unreachable(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unreachable)
    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def _assert_names_the_way_out(message, what):
    assert f"cannot reach the Hugging Face hub for {what}" in message
    assert "data.sources[*].paths" in message or "type: files" in message
    assert "python -m data.preshard" in message


def test_unreachable_hub_file_names_the_path_and_the_local_way(no_network):
    """data=long_data_collections offline: not httpx's ConnectError but an error naming the file, local paths and
    data.preshard (the real HfFileSystem request, failing at its DNS lookup)."""
    from data.sources import RemoteUnreachableError

    with pytest.raises(RemoteUnreachableError) as err:
        build_source({"type": "files", "paths": [LDC_FILE]})
    _assert_names_the_way_out(str(err.value), LDC_FILE)
    assert f"--paths '{LDC_FILE}'" in str(err.value)
    assert isinstance(err.value, ConnectionError)


def test_hub_offline_mode_says_so_instead_of_no_such_file(monkeypatch):
    from huggingface_hub import constants

    from data.sources import RemoteUnreachableError

    monkeypatch.setattr(constants, "is_offline_mode", lambda: True)
    with pytest.raises(RemoteUnreachableError, match="HF_HUB_OFFLINE is set") as err:
        expand_paths(LDC_FILE)
    _assert_names_the_way_out(str(err.value), LDC_FILE)


def test_a_stream_that_breaks_off_and_a_hub_dataset_say_the_same(monkeypatch, tmp_path):
    import datasets

    from data import sources
    from data.sources import RemoteUnreachableError

    # how httpx's transport errors look (recognised by class name and package)
    TransportError = type("TransportError", (Exception,), {"__module__": "httpx2._exceptions"})
    ConnectError = type("ConnectError", (TransportError,), {"__module__": "httpx2._exceptions"})

    def broken_open(path, mode="rb"):
        raise ConnectError("[Errno 101] Network is unreachable")

    monkeypatch.setattr(sources.fsspec, "open", broken_open)
    with pytest.raises(RemoteUnreachableError) as err:
        list(iter_file_records(LDC_FILE))
    _assert_names_the_way_out(str(err.value), LDC_FILE)
    with pytest.raises(ConnectError):  # a local path: the error is the file system's, not the network's
        list(iter_file_records(str(tmp_path / "a.jsonl")))

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'HuggingFaceFW/fineweb-edu' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RemoteUnreachableError) as err:
        build_source({"type": "hub", "name": "HuggingFaceFW/fineweb-edu", "config": "sample-10BT"})
    _assert_names_the_way_out(str(err.value), "the hub dataset 'HuggingFaceFW/fineweb-edu'")
    assert "--hub HuggingFaceFW/fineweb-edu" in str(err.value)


def test_errors_that_are_not_the_network_pass_through(monkeypatch):
    from data.sources import is_network_error

    assert not is_network_error(FileNotFoundError("no such file"))
    assert not is_network_error(ValueError("bad JSON"))
    assert is_network_error(TimeoutError()) and is_network_error(ConnectionRefusedError())
