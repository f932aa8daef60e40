"""Decays strong enough that a chunk's cumulative log decay passes fp32's exp range (about -88), on sequences and
documents that end inside a chunk: the Triton paths' outputs and every gradient stay finite and equal the chunked
torch path's. Rows past a sequence's end are loaded with a log decay of 0, so an unmasked exp(gamma_i - gamma_j)
between such a row and a real one overflows to inf, and inf * 0 = NaN reaches the real rows through a dot (the
delta rule's backward did, found while looking for why a Gated DeltaNet's loss went NaN). Both fp32 paths
against the float64 oracle; TRITON_INTERPRET on CPU."""
import os

import pytest
import torch

import hilo_kernels
from hilo_kernels.common import error_ratio

needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)

T, H, D = 100, 2, 16  # a chunk of 64 and a part chunk of 36: cumulative log decay about -135 in the part chunk
LOG_DECAY = -5.0      # per token, at most
TOL = 1e-4            # docs/kernels.md: fp32 paths against the fp32 oracle
# g's gradient is a difference of two sums (over a token's queries and over its keys) that nearly cancel at these
# decays: the chunked torch path and the kernels alike land 0.4-3e-4 from the float64 oracle.
TOL_DG = 1e-3


def inputs(t=T, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, t, H, D, generator=gen) for _ in range(3))
    q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    x = {"q": q, "k": k, "v": v, "beta": torch.rand(1, t, H, generator=gen),
         "g": LOG_DECAY * (0.5 + 0.5 * torch.rand(1, t, H, generator=gen)),
         "level_scales": torch.rand(1, t, H, 8, generator=gen) + 0.5}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return {n: x.to(dev, dtype).requires_grad_() for n, x in x.items()}


GATES = {"linear_attn": ("g",), "delta_rule": ("beta", "g"), "loglinear_attn": ("g", "level_scales"),
         "loglinear_delta_rule": ("beta", "g", "level_scales"), "hla2": ("g",), "ahla": ("g",), "hla3": ("g",)}
CASES = [(op, "triton") for op in GATES] + [("hla2", "fused"), ("ahla", "fused")]


def run(op, backend, x, cu_seqlens=None):
    out = getattr(hilo_kernels, op)(x["q"], x["k"], x["v"], **{n: x[n] for n in GATES[op]}, backend=backend,
                                    cu_seqlens=cu_seqlens)
    o = out[0] if isinstance(out, tuple) else out
    o.square().sum().backward()
    grads = {n: x[n].grad for n in ("q", "k", "v", *GATES[op])}
    return o.detach(), grads


@needs_triton
@pytest.mark.parametrize("op,backend", CASES)
@pytest.mark.parametrize("packed", [False, True], ids=["one sequence", "two documents"])
def test_strong_decay_in_a_part_chunk_stays_finite_and_exact(op, backend, packed):
    cu = None
    if packed:  # documents of 45 and 55 tokens: both end inside a chunk
        cu = torch.tensor([0, 45, T], dtype=torch.int32, device="cuda" if torch.cuda.is_available() else "cpu")
    ref_o, ref_grads = run(op, "naive", inputs(dtype=torch.float64), cu)
    for path in (backend, "torch"):
        o, grads = run(op, path, inputs(), cu)
        bad = [n for n, g in {"o": o, **grads}.items() if not torch.isfinite(g).all()]
        assert not bad, f"{op} ({path}): non-finite {bad}"
        assert error_ratio(o, ref_o) < TOL, path
        for n in grads:
            assert error_ratio(grads[n], ref_grads[n]) < (TOL_DG if n == "g" else TOL), (path, n)
