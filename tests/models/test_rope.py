"""models.rope: the shared tables (rope_tables, rotate) equal the definition (rope_cos_sin, apply_rope) bit for bit,
and a table is reused only for the same, unmodified position_ids."""

import pytest
import torch

from models.rope import apply_rope, rope_cos_sin, rope_tables, rotate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_equals_apply_rope_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 1 << 20, (2, 13), generator=gen)
    for d in (2, 32, 96):
        x = torch.randn(2, 13, 3, d, generator=gen).to(dtype)
        cos, sin = rope_cos_sin(pos, d, 10000.0)
        assert torch.equal(rotate(x, rope_tables(pos, d, 10000.0)), apply_rope(x, cos, sin))


def test_rope_tables_are_reused_only_for_the_same_unmodified_positions():
    pos = torch.arange(5).unsqueeze(0)
    tables = rope_tables(pos, 8, 10000.0)
    assert rope_tables(pos, 8, 10000.0) is tables  # the next layer of the same forward
    assert rope_tables(pos.clone(), 8, 10000.0) is not tables
    assert rope_tables(pos, 8, 500.0) is not tables
    assert rope_tables(pos, 16, 10000.0)[0].shape[-1] == 16
    pos.add_(3)  # an in-place change of the same tensor must not return the old tables
    fresh = rope_tables(pos, 8, 10000.0)
    expected = rope_tables(torch.arange(3, 8).unsqueeze(0), 8, 10000.0)
    assert all(torch.equal(a, b) for a, b in zip(fresh, expected))
    with torch.inference_mode():  # no version counter: never reused
        frozen = torch.arange(4).unsqueeze(0)
        assert rope_tables(frozen, 8, 10000.0) is not rope_tables(frozen, 8, 10000.0)
