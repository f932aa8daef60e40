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
