"""Two CPU processes (gloo, through `accelerate launch`) train like one process at the same global batch."""
import json
import os
import subprocess
import sys

from tests.training.helpers import REPO, SMALL, metrics

ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def _losses(run_dir):
    return [r["train/loss"] for r in metrics(run_dir) if "train/loss" in r]


def test_two_processes_match_one_process_at_the_same_global_batch(tmp_path):
    # data.shard=rows: the global batch is the same rows whatever the number of processes, so the two runs see
    # identical data and may differ only by the order of floating-point sums in the gradient all-reduce.
    common = [*SMALL, "trainer.max_steps=4", "trainer.save_every=2", "trainer.val_every=0", "data.shard=rows",
              "trainer.data_hashes=true"]
    one = subprocess.run([sys.executable, "train.py", *common, "trainer.batch_size=4",
                          f"hydra.run.dir={tmp_path / 'one'}"], cwd=REPO, env=ENV, capture_output=True, text=True,
                         timeout=300, check=False)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                          "conf/accelerate/cpu.yaml", "--num_processes", "2", "train.py", *common, "trainer.device=cpu",
                          "trainer.batch_size=2", f"hydra.run.dir={tmp_path / 'two'}"],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600, check=False)
    assert two.returncode == 0, two.stderr[-5000:]
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert abs(x - y) < 1e-4, (a, b)
    assert a[-1] < a[0]
    # every rank saved its own loader state, and the two ranks read different rows
    ckpt = tmp_path / "two" / "checkpoints" / "step_00000004"
    assert sorted(p.name for p in (ckpt / "loader").iterdir()) == ["rank00000.pt", "rank00001.pt"]
    assert json.loads((ckpt / "trainer_state.json").read_text())["world_size"] == 2
    # the per-rank row hashes: each rank 2 rows per step, none shared, and together the one process's rows
    from training.data_hashes import cross_rank_overlap, read_hashes
    from training.data_hashes import main as check_hashes

    report = cross_rank_overlap(read_hashes(tmp_path / "two"))
    assert report == {"rows": {0: 8, 1: 8}, "distinct": {0: 8, 1: 8}, "shared": 0}
    assert check_hashes([str(tmp_path / "two")]) == 0
    one_rows = [h for r in read_hashes(tmp_path / "one")[0] for h in r["rows"]]
    two_rows = [h for recs in read_hashes(tmp_path / "two").values() for r in recs for h in r["rows"]]
    assert sorted(one_rows) == sorted(two_rows)
    # the two-process step-2 checkpoint resumed by one process at the same global batch: model, optimizer and the
    # row stream continue, so steps 3 and 4 are the one-process run's
    resumed = subprocess.run([sys.executable, "train.py", *common, "trainer.batch_size=4",
                              f"trainer.resume={tmp_path / 'two' / 'checkpoints' / 'step_00000002'}",
                              f"hydra.run.dir={tmp_path / 'resumed'}"], cwd=REPO, env=ENV, capture_output=True,
                             text=True, timeout=300, check=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "restarts from its beginning" not in resumed.stderr
    c = _losses(tmp_path / "resumed")
    assert len(c) == 2 and all(abs(x - y) < 1e-4 for x, y in zip(c, a[2:])), (c, a)
    # the same global batch by accumulation (2 rows x 2 micro steps): the row stream does not depend on batch size
    accum = subprocess.run([sys.executable, "train.py", *common, "trainer.batch_size=2", "trainer.grad_accum=2",
                            f"trainer.resume={tmp_path / 'two' / 'checkpoints' / 'step_00000002'}",
                            f"hydra.run.dir={tmp_path / 'accum'}"], cwd=REPO, env=ENV, capture_output=True,
                           text=True, timeout=300, check=False)
    assert accum.returncode == 0, accum.stderr[-3000:]
    d = _losses(tmp_path / "accum")
    assert len(d) == 2 and all(abs(x - y) < 1e-4 for x, y in zip(d, a[2:])), (d, a)


def test_document_sharding_gives_each_rank_distinct_data(tmp_path):
    import torch

    from data import build_train_loader, load_tokenizer

    tok = load_tokenizer({"type": "sentencepiece", "vocab_size": 8192})
    from omegaconf import OmegaConf

    from tests.training.helpers import small_cfg

    data_cfg = OmegaConf.to_container(small_cfg().data, resolve=True)
    streams = []
    for rank in range(2):
        loader = build_train_loader(data_cfg, tok, seq_len=64, batch_size=4, rank=rank, world_size=2, seed=0)
        streams.append(torch.cat([next(loader)["input_ids"].flatten() for _ in range(5)]))
    rows = [set(map(tuple, s.view(-1, 64).tolist())) for s in streams]
    assert not rows[0] & rows[1]


def test_data_hash_check_reports_shared_rows_and_errors(tmp_path):
    import pytest
    import torch

    from training.data_hashes import DataHashWriter
    from training.data_hashes import main as check_hashes

    with pytest.raises(FileNotFoundError, match="trainer.data_hashes=true"):
        check_hashes([str(tmp_path)])
    rows = torch.arange(12).view(3, 4)
    DataHashWriter(tmp_path, 0).write(1, 0, rows[:2])
    DataHashWriter(tmp_path, 1).write(1, 0, rows[1:])  # row 1 on both ranks
    assert check_hashes([str(tmp_path)]) == 1
    (tmp_path / "data_hashes" / "rank00001.jsonl").write_text("{broken\n")
    with pytest.raises(ValueError, match="rank00001.jsonl:1"):
        check_hashes([str(tmp_path)])
