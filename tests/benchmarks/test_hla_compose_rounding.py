"""benchmarks/hla_compose_rounding.py on a short sequence: rounding the intermediate to bf16 costs a bounded, nonzero
error on top of rounding the output alone, for both ops, with and without decay."""
import pytest

from benchmarks.hla_compose_rounding import measure, measure_whole_bf16


@pytest.mark.parametrize("op", ["hla2", "ahla"])
@pytest.mark.parametrize("decay", [False, True])
def test_rounding_the_intermediate_costs_a_bounded_error(op, decay):
    errs = measure(op, 200, 1, 32, decay)
    out_only, with_mid = errs["output only"], errs["with the intermediate"]
    assert all(1e-3 < e < 2.5e-3 for e in out_only), out_only  # bf16's unit roundoff over sqrt(3): about 1.6e-3
    assert all(a < b < 4e-3 for a, b in zip(out_only, with_mid, strict=True)), errs


def test_whole_bf16_proxy_is_a_bf16_sized_error():
    errs = measure_whole_bf16("hla2", 150, 1, 32)
    assert all(1e-3 < e < 1e-2 for e in errs), errs  # bf16 rounding throughout, far from fp64 and from failure
