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


def test_gate_grad_forms_agree_exactly_and_the_chunk_forms_round_less():
    """linear_attn's dg in its three forms: equal without rounding (and equal to autograd of the naive operator), and
    in bf16 the per-chunk forms' errors are several times smaller than one reverse sum over the document."""
    from benchmarks.kernel_rounding import gate_grad_forms

    x = _make_linear_attn(2, 200, 2, 32, "cpu", seed=5, n_state=2)
    gen = torch.Generator().manual_seed(6)
    do, dfinal = torch.randn(2, 200, 2, 32, generator=gen), torch.randn(2, 2, 32, 32, generator=gen)
    exact = gate_grad_forms(x, do, dfinal, False)
    leaves = {n: t.double().requires_grad_(n == "g") for n, t in x.items()}
    o, final = linear_attn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], initial_state=leaves["initial_state"],
                           output_final_state=True, backend="naive")
    (dg,) = torch.autograd.grad((o * do.double()).sum() + (final * dfinal.double()).sum(), [leaves["g"]])
    for name, value in exact.items():
        assert error_ratio(value, dg) < 1e-12, name
    got = {name: error_ratio(value, dg) for name, value in gate_grad_forms(x, do, dfinal, True).items()}
    assert got["chunk programs"] < 0.6 * got["document sum"] and got["dstates pass"] < 0.6 * got["document sum"], got
