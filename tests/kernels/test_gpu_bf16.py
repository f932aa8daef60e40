"""On a GPU: every Triton operator in bf16 against its fp32 oracle, outputs, final states and every gradient, at
SPEC §2's tolerances (the same check benchmarks/kernels.py prints before it times). Skipped without CUDA."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 Triton checks need a CUDA GPU")


def _cases():
    from benchmarks.kernels import CASES

    return sorted(CASES)


@pytest.mark.gpu
@pytest.mark.parametrize("op", _cases())
def test_bf16_triton_matches_fp32_oracle(op):
    from benchmarks.kernels import CASES, check

    rows = check(op, CASES[op], "cuda")
    assert rows
    failures = [f"{shape} {qty}: {err:.2e} > {tol:.0e}" for shape, qty, err, tol in rows if not err <= tol]
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["loglinear_attn", "loglinear_delta_rule"])
def test_bf16_loglinear_long_sequence(op):
    """T = 20000 reaches chunk level 9 (16 stacked levels in the level scans, a padded tile) and a prior state at
    position 100: bf16 Triton vs the fp32 chunked path, every gradient."""
    from benchmarks.kernels import CASES, OUT_TOL, _run_with_grads
    from kernels.common import error_ratio

    case = CASES[op]
    inputs = case.make(1, 20000, 2, 64, "cuda", seed=3, n_state=1)
    o, s, g = _run_with_grads(case, inputs, None, "triton", torch.bfloat16)
    ro, rs, rg = _run_with_grads(case, inputs, None, "torch", torch.float32)
    rows = [("o", error_ratio(o, ro), OUT_TOL), ("final_state", error_ratio(s, rs), OUT_TOL)]
    rows += [("d" + n, error_ratio(g[n], rg[n]), case.grad_tol[n]) for n in g]
    failures = [f"{name}: {err:.2e} > {tol:.0e}" for name, err, tol in rows if not err <= tol]
    assert not failures, "\n".join(failures)
