"""On a GPU: the recurrent operators' Triton kernels (linear_attn, delta_rule, the log-linear pair and HLA's fused
hla2 / ahla) in bf16 at the small and uneven head dims models use (MQAR's Mamba-2 has K = 32, V = 16; GDN at
width 32 has K = 32, V = 64) and the delta rules at Gated DeltaNet 340m's K = 256, V = 512, against the fp32
chunked path.

Triton 3.6 on Hopper miscompiled linear_attn's output kernel at some narrow V tiles (wrong values at K = 64,
V = 16 / 32, an illegal access at K = 32, V = 16), which the D = 128 checks of test_gpu_bf16 never saw. Skipped
without CUDA."""
import pytest
import torch

from hilo_kernels import ahla, delta_rule, hla2, hla3, linear_attn, loglinear_attn, loglinear_delta_rule
from hilo_kernels.common import error_ratio
from hilo_kernels.loglinear_attn import num_levels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 Triton checks need a CUDA GPU")

DIMS = [(16, 16), (32, 16), (64, 16), (128, 16), (64, 32), (32, 64), (128, 64), (60, 100), (100, 60), (256, 128)]


def _grads(op, backend, dtype, x):
    leaves = [x[n].to(dtype).requires_grad_() for n in ("q", "k", "v")] + [x["g"].clone().requires_grad_()]
    if op in ("delta_rule", "loglinear_delta_rule"):
        leaves.append(x["beta"].clone().requires_grad_())
    if op.startswith("loglinear"):
        leaves.append(x["lam"].clone().requires_grad_())
    q, k, v, g = leaves[:4]
    if op == "delta_rule":
        o, _ = delta_rule(q, k, v, beta=leaves[4], g=g, backend=backend)
    elif op == "loglinear_delta_rule":
        o, _ = loglinear_delta_rule(q, k, v, beta=leaves[4], g=g, level_scales=leaves[5], backend=backend)
    elif op == "loglinear_attn":
        o, _ = loglinear_attn(q, k, v, g=g, level_scales=leaves[4], backend=backend)
    elif op in ("hla2", "ahla", "hla2_compose", "hla3_compose"):  # scale keeps second order near 1
        fn = {"ahla": ahla, "hla3_compose": hla3}.get(op, hla2)
        kernels = "triton" if op.endswith("_compose") else "fused"  # the linear_attn passes or the fused kernels
        o, _ = fn(q, k, v, g=g, scale=q.shape[-1] ** -0.5, backend=kernels if backend == "triton" else backend)
    else:
        o, _ = linear_attn(q, k, v, g=g, backend=backend)
    grads = torch.autograd.grad(o.float(), leaves, x["do"])
    return [o.float()] + [d.float() for d in grads]


def _check_bf16(op, dk, dv):
    """bf16 Triton against the fp32 chunked path: the output and every gradient within the bf16 tolerances of docs/kernels.md."""
    gen = torch.Generator(device="cuda").manual_seed(dk * 1000 + dv)
    b, t, h = 3, 200, 2
    x = {"q": torch.randn(b, t, h, dk, device="cuda", generator=gen),
         "k": torch.nn.functional.normalize(torch.randn(b, t, h, dk, device="cuda", generator=gen), dim=-1),
         "v": torch.randn(b, t, h, dv, device="cuda", generator=gen),
         "g": -torch.rand(b, t, h, device="cuda", generator=gen) * 0.2,
         "beta": torch.rand(b, t, h, device="cuda", generator=gen),
         "lam": torch.rand(b, t, h, num_levels(t), device="cuda", generator=gen) + 0.5,
         "do": torch.randn(b, t, h, dv, device="cuda", generator=gen)}
    ref = _grads(op, "torch", torch.float32, x)
    got = _grads(op, "triton", torch.bfloat16, x)
    names = ["o", "dq", "dk", "dv", "dg"] + (["dbeta"] if "delta" in op else []) + (["dlam"] if "log" in op else [])
    tols = [5e-3, 1e-2, 1e-2, 1e-2, 2e-2, 2e-2, 2e-2]
    bad = [f"{n}: {error_ratio(a, r):.2e} > {tol:.0e}" for n, a, r, tol in zip(names, got, ref, tols)
           if not error_ratio(a, r) <= tol]
    assert not bad, f"{op} K={dk} V={dv}: " + "; ".join(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["linear_attn", "delta_rule", "loglinear_attn", "loglinear_delta_rule", "hla2", "ahla"])
@pytest.mark.parametrize("dk,dv", DIMS)
def test_bf16_triton_small_head_dims(op, dk, dv):
    _check_bf16(op, dk, dv)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["hla2", "hla3"])
@pytest.mark.parametrize("dk,dv", [(128, 64), (64, 32), (32, 64), (128, 128), (60, 100), (256, 128)])
def test_bf16_hla_composition_head_dims(op, dk, dv):
    """hla2's and hla3's bf16 default on CUDA (linear_attn passes, as one op where they fit the accumulating
    one-tile backward: K <= 128, and for hla3 V <= 128) at uneven head dims: hla_mamba2's K = 128, V = 64 among
    them; K = 256 takes the separate passes."""
    _check_bf16(f"{op}_compose", dk, dv)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["delta_rule", "loglinear_delta_rule"])
def test_bf16_triton_wide_value_heads(op):
    """K = 256, V = 512: Gated DeltaNet 340m's heads, which the delta rules take in one call (V up to 512; the
    loglinear one's split backward then loops over its V-blocks instead of unrolling them, triton_bwd.v_span)."""
    _check_bf16(op, 256, 512)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["linear_attn", "delta_rule"])
@pytest.mark.parametrize("dk,dv", [(128, 128), (256, 128)])
def test_fp32_triton_wide_heads(op, dk, dv):
    """fp32 inputs at wide heads (hla's composition runs its linear_attn passes in fp32): they must fit the GPU's
    shared memory (linear_attn's fused backward at 128 x 128 needed 272 KiB) and match at the fp32 tolerance of docs/kernels.md."""
    gen = torch.Generator(device="cuda").manual_seed(dk + dv)
    b, t, h = 2, 150, 2
    x = {"q": torch.randn(b, t, h, dk, device="cuda", generator=gen),
         "k": torch.nn.functional.normalize(torch.randn(b, t, h, dk, device="cuda", generator=gen), dim=-1),
         "v": torch.randn(b, t, h, dv, device="cuda", generator=gen),
         "g": -torch.rand(b, t, h, device="cuda", generator=gen) * 0.2,
         "beta": torch.rand(b, t, h, device="cuda", generator=gen),
         "do": torch.randn(b, t, h, dv, device="cuda", generator=gen)}
    ref = _grads(op, "torch", torch.float32, x)
    got = _grads(op, "triton", torch.float32, x)
    bad = [f"{i}: {error_ratio(a, r):.2e}" for i, (a, r) in enumerate(zip(got, ref)) if not error_ratio(a, r) <= 1e-4]
    assert not bad, f"{op} fp32 K={dk} V={dv}: " + "; ".join(bad)
