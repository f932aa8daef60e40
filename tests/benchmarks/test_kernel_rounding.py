"""benchmarks/kernel_rounding.py on a short sequence: with nothing rounded its emulation of linear_attn's chunked
forward is the operator itself (and its compositions are hla2 / ahla); each rounding costs a bf16-sized error; the
split scores take back most of what rounding the scores costs."""
import pytest
import torch

from benchmarks.kernel_rounding import ROUNDINGS, forward
from benchmarks.kernels import _make_hla, _make_linear_attn
from kernels import ahla, hla2, linear_attn
from kernels.common import error_ratio
from kernels.hla.state import AHLAState, HLA2State

SHAPE = (1, 150, 2, 32, "cpu")  # three chunks, the last one partial


def test_unrounded_emulation_is_the_operator():
    x = _make_linear_attn(*SHAPE, seed=1, n_state=1)
    xd = {n: t.double() for n, t in x.items()}
    ref, _ = linear_attn(xd["q"], xd["k"], xd["v"], xd["g"], initial_state=xd["initial_state"], backend="naive")
    assert error_ratio(forward("linear_attn", x, set()), ref) < 1e-12
    x = _make_hla(*SHAPE, seed=2, n_state=1)
    xd = {n: t.double() for n, t in x.items()}
    for op, fn, state in (("hla2", hla2, HLA2State), ("ahla", ahla, AHLAState)):
        h0 = state(*xd["initial_state"].split(32, dim=-1))
        ref, _ = fn(xd["q"], xd["k"], xd["v"], xd["g"], initial_state=h0, backend="naive")
        assert error_ratio(forward(op, x, set()), ref) < 1e-12, op


@pytest.mark.parametrize("name", [r for r in ROUNDINGS if r != "intermediate"])
def test_each_rounding_costs_a_bf16_sized_error(name):
    x = _make_linear_attn(*SHAPE, seed=3, n_state=1)
    ref = forward("linear_attn", x, set())
    assert 1e-5 < error_ratio(forward("linear_attn", x, {name}), ref) < 5e-3


def test_split_scores_recovers_the_scores_rounding():
    x = _make_hla(*SHAPE, seed=4, n_state=1)
    ref = forward("ahla", x, set())
    scores = error_ratio(forward("ahla", x, {"scores"}), ref)
    split = error_ratio(forward("ahla", x, {"scores"}, split=True), ref)
    assert split < 0.05 * scores, (split, scores)
    every = set(ROUNDINGS)
    assert error_ratio(forward("ahla", x, every, split=True), ref) < error_ratio(forward("ahla", x, every), ref)
    assert torch.isfinite(forward("ahla", x, every)).all()
