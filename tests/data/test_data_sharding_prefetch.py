"""data.shard=rows gives the same global batches for any number of processes; prefetching changes nothing."""
import pytest
import torch

from data import build_train_loader
from tests.data.helpers import ByteTokenizer
from tests.data.test_data_loader import assert_same, batches, mixed_cfg

TOK = ByteTokenizer()
KW = {"seq_len": 24, "seed": 7}


@pytest.mark.parametrize("packing", ["fixed", "varlen"])
def test_row_sharding_splits_the_one_process_global_batch(tmp_path, packing):
    cfg = {**mixed_cfg(tmp_path, packing), "shard": "rows"}
    single = batches(build_train_loader(cfg, TOK, batch_size=6, rank=0, world_size=1, **KW), 8)
    per_rank = [batches(build_train_loader(cfg, TOK, batch_size=2, rank=r, world_size=3, **KW), 8)
                for r in range(3)]
    for step, whole in enumerate(single):
        parts = [per_rank[r][step] for r in range(3)]
        if packing == "fixed":
            assert torch.equal(torch.cat([p["input_ids"] for p in parts]), whole["input_ids"])
            continue
        for key in ("input_ids", "labels", "position_ids"):
            assert torch.equal(torch.cat([p[key] for p in parts], dim=1), whole[key])
        # each rank's cu_seqlens are the global ones inside its slice, shifted to start at 0
        offsets, rebuilt = 0, [0]
        for p in parts:
            cu = p["cu_seqlens"]
            assert cu[0] == 0 and cu[-1] == p["input_ids"].shape[1]
            rebuilt.extend((cu[1:] + offsets).tolist())
            offsets += p["input_ids"].shape[1]
        assert rebuilt == whole["cu_seqlens"].tolist()


def test_row_sharded_resume_is_exact_and_state_is_checked(tmp_path):
    cfg = {**mixed_cfg(tmp_path, "varlen"), "shard": "rows"}
    reference = batches(build_train_loader(cfg, TOK, batch_size=2, rank=1, world_size=2, **KW), 12)
    first = build_train_loader(cfg, TOK, batch_size=2, rank=1, world_size=2, **KW)
    head = batches(first, 5)
    resumed = build_train_loader(cfg, TOK, batch_size=2, rank=1, world_size=2, **KW)
    resumed.load_state_dict(first.state_dict())
    assert_same(head + batches(resumed, 7), reference)
    other_rank = build_train_loader(cfg, TOK, batch_size=2, rank=0, world_size=2, **KW)
    with pytest.raises(ValueError, match="row-sharded rank 0/2"):
        other_rank.load_state_dict(first.state_dict())


def test_prefetching_yields_the_same_stream_and_state(tmp_path):
    cfg = mixed_cfg(tmp_path, "fixed")
    plain = build_train_loader({**cfg, "prefetch": 0}, TOK, batch_size=3, **KW)
    ahead = build_train_loader({**cfg, "prefetch": 3}, TOK, batch_size=3, **KW)
    assert_same(batches(plain, 9), batches(ahead, 9))
    # the state is that after the 9th batch handed out, not after the batches prepared beyond it
    assert ahead.state_dict() == plain.state_dict()
    assert ahead.stats["batches"] == 9
    ahead.close()
    with pytest.raises(RuntimeError, match="before the first batch"):
        ahead.load_state_dict(plain.state_dict())


def test_prefetch_thread_errors_reach_the_caller(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{broken\n" * 5)
    loader = build_train_loader({"sources": [{"type": "files", "paths": [str(bad)]}], "prefetch": 2}, TOK,
                                batch_size=2, **KW)
    with pytest.raises(ValueError, match="malformed"):
        next(loader)


@pytest.mark.parametrize("key, value, needle", [("shard", "files", "data.shard"), ("prefetch", -1, "data.prefetch")])
def test_bad_sharding_settings(tmp_path, key, value, needle):
    with pytest.raises(ValueError, match=needle):
        build_train_loader({**mixed_cfg(tmp_path, "fixed"), key: value}, TOK, batch_size=2, **KW)
