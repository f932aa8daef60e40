"""On a GPU: every Triton operator in bf16 against its fp32 oracle, outputs, final states and every gradient, at
the tolerances of hilo_kernels/common/checks.py (docs/kernels.md; the same check benchmarks/operators.py prints before it
times). Skipped without CUDA."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 Triton checks need a CUDA GPU")


def _cases():
    from hilo_kernels.common.checks import CASES

    return sorted(CASES)


@pytest.mark.gpu
@pytest.mark.parametrize("op", _cases())
def test_bf16_triton_matches_fp32_oracle(op):
    from hilo_kernels.common.checks import CASES, check

    rows = check(op, CASES[op], "cuda")
    assert rows
    failures = [f"{shape} {qty}: {err:.2e} > {tol:.0e}" for shape, qty, err, tol in rows if not err <= tol]
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["loglinear_attn", "loglinear_delta_rule"])
def test_bf16_loglinear_long_sequence(op):
    """T = 20000 reaches chunk level 9 (16 stacked levels in the level scans, a padded tile) and a prior state at
    position 100: bf16 Triton vs the fp32 chunked path, every gradient."""
    from hilo_kernels.common import error_ratio
    from hilo_kernels.common.checks import CASES, OUT_TOL, run_with_grads

    case = CASES[op]
    inputs = case.make(1, 20000, 2, 64, "cuda", seed=3, n_state=1)
    o, s, g = run_with_grads(case, inputs, None, "triton", torch.bfloat16)
    ro, rs, rg = run_with_grads(case, inputs, None, "torch", torch.float32)
    rows = [("o", error_ratio(o, ro), OUT_TOL), ("final_state", error_ratio(s, rs), OUT_TOL)]
    rows += [("d" + n, error_ratio(g[n], rg[n]), case.grad_tol[n]) for n in g]
    failures = [f"{name}: {err:.2e} > {tol:.0e}" for name, err, tol in rows if not err <= tol]
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["loglinear_attn", "loglinear_delta_rule"])
@pytest.mark.parametrize("dk,dv", [(16, 16), (32, 16), (64, 16), (128, 16), (64, 32), (32, 64), (60, 100),
                                   (256, 128)])
def test_bf16_loglinear_small_head_dims(op, dk, dv):
    """The log-linear ops at the small and uneven head dims models use (narrow V tiles: Triton 3.6 on Hopper
    miscompiled some of linear_attn's, see tests/kernels/test_gpu_head_dims.py), T = 700 (four chunk levels) and
    T = 100 (one), bf16 vs the fp32 chunked path."""
    from hilo_kernels import loglinear_attn, loglinear_delta_rule
    from hilo_kernels.common import error_ratio
    from hilo_kernels.loglinear_attn import num_levels

    for t in (700, 100):
        gen = torch.Generator(device="cuda").manual_seed(dk * 1000 + dv + t)
        b, h = 2, 2
        x = {"q": torch.randn(b, t, h, dk, device="cuda", generator=gen),
             "k": torch.nn.functional.normalize(torch.randn(b, t, h, dk, device="cuda", generator=gen), dim=-1),
             "v": torch.randn(b, t, h, dv, device="cuda", generator=gen),
             "g": -torch.rand(b, t, h, device="cuda", generator=gen) * 0.2,
             "beta": torch.rand(b, t, h, device="cuda", generator=gen),
             "lam": torch.rand(b, t, h, num_levels(t), device="cuda", generator=gen) + 0.5,
             "do": torch.randn(b, t, h, dv, device="cuda", generator=gen)}
        results = {}
        for backend, dtype in (("torch", torch.float32), ("triton", torch.bfloat16)):
            order = ("q", "k", "v", "g", "lam") if op == "loglinear_attn" else ("q", "k", "v", "beta", "g", "lam")
            leaves = {n: x[n].to(dtype if n in ("q", "k", "v") else torch.float32).requires_grad_() for n in order}
            fn = loglinear_attn if op == "loglinear_attn" else loglinear_delta_rule
            q, k, v = (leaves[n] for n in ("q", "k", "v"))
            gates = {n: leaves[n] for n in leaves if n not in ("q", "k", "v", "lam")}
            o, _ = fn(q, k, v, **gates, level_scales=leaves["lam"], backend=backend)
            grads = torch.autograd.grad(o.float(), list(leaves.values()), x["do"])
            results[backend] = [o.float()] + [d.float() for d in grads]
        names = ["o"] + ["d" + n for n in leaves]
        tols = [5e-3, 1e-2, 1e-2, 1e-2] + [2e-2] * (len(names) - 4)
        bad = [f"{n}: {error_ratio(a, r):.2e} > {tol:.0e}" for n, a, r, tol in
               zip(names, results["triton"], results["torch"], tols) if not error_ratio(a, r) <= tol]
        assert not bad, f"{op} K={dk} V={dv} T={t}: " + "; ".join(bad)


@pytest.mark.gpu
@pytest.mark.parametrize(("groups", "heads", "dk", "dv", "varlen"), [(1, 8, 128, 64, False), (2, 6, 64, 32, True),
                                                                    (1, 4, 128, 160, False)])
def test_bf16_linear_attn_grouped_q_k(groups, heads, dk, dv, varlen):
    """Mamba-2's layout: q, k with G heads for H heads of v, read per group by the kernels (no repeat), bf16 Triton
    against the fp32 chunked path on the heads repeated; dq, dk are the sums over each group's heads. V = 160 takes
    the two-kernel backward, the others the fused one; fixed length (the custom op) and packed documents."""
    from hilo_kernels import linear_attn
    from hilo_kernels.common import error_ratio

    gen = torch.Generator(device="cuda").manual_seed(groups * 100 + dk + dv)
    b, t = (1, 900) if varlen else (2, 450)
    x = {"q": torch.randn(b, t, groups, dk, device="cuda", generator=gen),
         "k": torch.randn(b, t, groups, dk, device="cuda", generator=gen) * dk ** -0.5,
         "v": torch.randn(b, t, heads, dv, device="cuda", generator=gen),
         "g": -torch.rand(b, t, heads, device="cuda", generator=gen) * 0.1}
    do = torch.randn(b, t, heads, dv, device="cuda", generator=gen)
    cu = torch.tensor([0, 333, 900], device="cuda") if varlen else None
    results = {}
    for backend, dtype in (("triton", torch.bfloat16), ("torch", torch.float32)):
        leaves = {n: x[n].to(dtype if n != "g" else torch.float32).requires_grad_() for n in x}
        q, k = leaves["q"], leaves["k"]
        if backend == "torch":  # the reference on repeated heads (autograd sums their gradients)
            q, k = (z.repeat_interleave(heads // groups, dim=2) for z in (q, k))
        o, _ = linear_attn(q, k, leaves["v"], g=leaves["g"], cu_seqlens=cu, backend=backend)
        grads = torch.autograd.grad(o.float(), list(leaves.values()), do)
        results[backend] = [o.float()] + [d.float() for d in grads]
    names, tols = ["o", "dq", "dk", "dv", "dg"], [5e-3, 1e-2, 1e-2, 1e-2, 2e-2]
    bad = [f"{n}: {error_ratio(a, r):.2e} > {tol:.0e}" for n, a, r, tol in
           zip(names, results["triton"], results["torch"], tols) if not error_ratio(a, r) <= tol]
    assert not bad, f"G={groups} H={heads} K={dk} V={dv}: " + "; ".join(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["hla2", "hla3"])
def test_bf16_hla_compose16_matches_fp32_oracle(op):
    """compose16: hla2 and hla3 as compositions of linear_attn's bf16 kernels (K~ / V~ rounded to bf16 between the
    passes, their default on CUDA for bf16 inputs) against the fp32 oracle at the bf16 tolerances of
    docs/kernels.md, with and without packed documents."""
    import dataclasses

    from hilo_kernels.common.checks import CASES, check

    rows = check(op, dataclasses.replace(CASES[op], backend="triton", baselines={}), "cuda")
    assert rows
    failures = [f"{shape} {qty}: {err:.2e} > {tol:.0e}" for shape, qty, err, tol in rows if not err <= tol]
    assert not failures, "\n".join(failures)
