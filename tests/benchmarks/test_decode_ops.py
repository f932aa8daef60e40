"""benchmarks/decode_ops.py: the aten ops of one cached decoding step, and that no family's step synchronises with
the host (a .item() or a boolean index would show up as _local_scalar_dense / nonzero)."""

import pytest
import torch

from benchmarks.decode import FAMILIES, build
from benchmarks.decode_ops import count_step_ops, main

HOST_SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::item", "aten::equal", "aten::is_nonzero")


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_step_has_no_host_sync(family):
    model, cfg = build(family, "tiny", 512, [], 97, torch.device("cpu"), torch.float32)
    counts = count_step_ops(model)
    assert sum(counts.values()) > cfg.num_layers  # at least an op per layer: the count sees the step
    assert not [k for k in counts if k.startswith(HOST_SYNC_OPS)], counts


def test_main_prints_a_row_per_family(capsys):
    rows = main(["--size", "tiny", "--families", "mamba2", "transformer"])
    assert [r["family"] for r in rows] == ["mamba2", "transformer"]
    out = capsys.readouterr().out
    assert "| mamba2 | tiny |" in out and "| transformer | tiny |" in out
    assert rows[0]["ops"] == sum(rows[0]["counts"].values())
