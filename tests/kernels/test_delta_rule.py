"""hilo_kernels.delta_rule: the naive oracle against an explicit-matrix definition, then the chunked torch path and the
Triton kernels (under TRITON_INTERPRET=1 on CPU, in fp32) against the oracle: outputs, final states, every
gradient (q, k, v, beta, g, initial_state), varlen without leakage, and decoding steps."""

import itertools
import os

import pytest
import torch
from compile_checks import assert_one_graph_with_eager_values
from graph_checks import assert_no_per_chunk_selects
from in_order import delta_rule_pos

from hilo_kernels import delta_rule
from hilo_kernels.delta_rule import delta_rule_step

TOL = 1e-4  # docs/kernels.md: fp32 torch and interpreter runs against the fp32 oracle


def err_ratio(out: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS(out - ref) / RMS(ref), as fla measures kernels."""
    out, ref = out.double(), ref.double()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def make(b, t, h, dk, dv, seed=0, decay="weak", normalize=True, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, dk, generator=gen)
    k = torch.randn(b, t, h, dk, generator=gen)
    if normalize:
        k = torch.nn.functional.normalize(k, dim=-1)
    else:
        # Not unit norm, but |k|^2 * beta < 2 keeps (I - beta k k^T) contractive-ish so nothing blows up.
        k = k * (1.3 / dk ** 0.5)
    v = torch.randn(b, t, h, dv, generator=gen)
    beta = torch.rand(b, t, h, generator=gen)
    scale = {"weak": 0.05, "strong": 3.0, "zero": 0.0}.get(decay)
    g = None if decay is None else -torch.rand(b, t, h, generator=gen) * scale
    return [x if x is None else x.to(dtype) for x in (q, k, v, beta)] + [g]


def test_chunk_loop_is_linear_in_chunks():
    def forward(t):
        q, k, v, beta, g = (x.requires_grad_() for x in make(2, t, 2, 8, 4))
        o, s = delta_rule(q, k, v, beta=beta, g=g, output_final_state=True, backend="torch")
        return o.sum() + s.sum()

    assert_no_per_chunk_selects(forward, 64 * 2, 64 * 6)


def matrix_reference(q, k, v, beta, g, h0=None, scale=None):
    """The definition (docs/kernels.md) with explicit K x K transition matrices, float64, one sequence per batch row."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    q, k, v, beta = q.double(), k.double(), v.double(), beta.double()
    out = torch.zeros(b, t, h, dv, dtype=torch.float64)
    final = torch.zeros(b, h, dk, dv, dtype=torch.float64)
    eye = torch.eye(dk, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            s = torch.zeros(dk, dv, dtype=torch.float64) if h0 is None else h0[bi, hi].double()
            for i in range(t):
                kt = k[bi, i, hi][:, None]
                a = 1.0 if g is None else float(torch.exp(g[bi, i, hi].double()))
                s = a * (eye - beta[bi, i, hi] * kt @ kt.T) @ s + beta[bi, i, hi] * kt @ v[bi, i, hi][None, :]
                out[bi, i, hi] = scale * q[bi, i, hi] @ s
            final[bi, hi] = s
    return out, final


def run(backend, inputs, h0=None, cu=None, grads=True, seed=7):
    """Forward (and backward with fixed random cotangents) of one backend; returns [o, final, *grads]."""
    q, k, v, beta, g = inputs
    leaves = [x.detach().clone().requires_grad_(grads) if x is not None else None for x in (q, k, v, beta, g, h0)]
    o, final = delta_rule_pos(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu,
                          backend=backend)
    if not grads:
        return [o.detach(), final.detach()]
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(o)
    dfinal = torch.randn(final.shape, generator=gen).to(final)
    ((o * do).sum() + (final * dfinal).sum()).backward()
    return [o.detach(), final.detach()] + [x.grad for x in leaves if x is not None]


def assert_close(got, ref, tol=TOL, what=""):
    names = ["o", "final", "dq", "dk", "dv", "dbeta", "dg/dh0", "dh0"]
    for i, (a, b) in enumerate(zip(got, ref)):
        r = err_ratio(a, b)
        assert r <= tol, f"{what} {names[i]}: error ratio {r:.2e} > {tol:.0e}"


# ---------------------------------------------------------------- oracle and chunked torch path

@pytest.mark.parametrize("decay", ["weak", "strong", None])
def test_naive_matches_matrix_definition(decay):
    q, k, v, beta, g = make(2, 13, 2, 6, 5, seed=1, decay=decay, normalize=False)
    h0 = torch.randn(2, 2, 6, 5)
    o, final = delta_rule(q, k, v, beta=beta, g=g, initial_state=h0, output_final_state=True, backend="naive")
    ro, rf = matrix_reference(q, k, v, beta, g, h0)
    assert err_ratio(o, ro) <= 1e-6 and err_ratio(final, rf) <= 1e-6


@pytest.mark.parametrize("t,dk,dv,decay,normalize", [
    (500, 100, 100, "weak", True),
    (75, 60, 100, "strong", False),
    (63, 100, 60, "zero", True),
    (130, 32, 16, None, False),
])
def test_chunk_matches_naive(t, dk, dv, decay, normalize):
    inputs = make(1 if t == 500 else 2, t, 2, dk, dv, seed=2, decay=decay, normalize=normalize)
    h0 = torch.randn(inputs[0].shape[0], 2, dk, dv)
    assert_close(run("torch", inputs, h0), run("naive", inputs, h0), what="torch")


def test_chunk_varlen_equals_separate_runs():
    inputs = make(1, 90, 2, 16, 12, seed=3)
    bounds = [0, 1, 16, 16, 60, 90]  # lengths 1, 15, 0, 44, 30
    cu = torch.tensor(bounds)
    h0 = torch.randn(len(bounds) - 1, 2, 16, 12)
    packed = run("torch", inputs, h0, cu=cu, grads=False)
    assert_close(packed, run("naive", inputs, h0, cu=cu, grads=False), what="varlen")
    for n, (s, e) in enumerate(itertools.pairwise(bounds)):
        if s == e:
            assert torch.equal(packed[1][n], h0[n]), "an empty document must return its initial state"
            continue
        part = [x[:, s:e] for x in inputs]
        o, final = run("naive", part, h0[n : n + 1], grads=False)
        assert err_ratio(packed[0][:, s:e], o) <= TOL and err_ratio(packed[1][n], final[0]) <= TOL


def test_step_equals_forward():
    q, k, v, beta, g = make(2, 20, 3, 16, 8, seed=4)
    h0 = torch.randn(2, 3, 16, 8)
    o_full, final = delta_rule(q, k, v, beta=beta, g=g, initial_state=h0, output_final_state=True, backend="torch")
    state = h0.clone()
    outs = []
    for i in range(20):
        o, state = delta_rule_step(q[:, i], k[:, i], v[:, i], beta=beta[:, i], g=g[:, i], state=state)
        outs.append(o)
    assert err_ratio(torch.stack(outs, 1), o_full) <= TOL
    assert err_ratio(state, final) <= TOL


def test_default_scale_and_no_final_state():
    q, k, v, beta, g = make(1, 10, 2, 16, 8, seed=5)
    o_default, final = delta_rule(q, k, v, beta=beta, g=g, backend="torch")
    assert final is None
    o_explicit, _ = delta_rule(q, k, v, beta=beta, g=g, scale=0.25, backend="naive")
    assert err_ratio(o_default, o_explicit) <= TOL
    o_other, _ = delta_rule(q, k, v, beta=beta, g=g, scale=1.0, backend="naive")
    assert err_ratio(o_other, o_explicit * 4) <= TOL


def test_errors_are_clear():
    q, k, v, beta, g = make(2, 10, 2, 8, 8, seed=6)
    with pytest.raises(ValueError, match="q and k must have the same shape"):
        delta_rule(q, k[..., :4], v, beta=beta, g=g)
    with pytest.raises(ValueError, match="beta must have shape"):
        delta_rule(q, k, v, beta=beta[..., :1], g=g)
    with pytest.raises(ValueError, match="g must have shape"):
        delta_rule(q, k, v, beta=beta, g=g[:, :3])
    with pytest.raises(TypeError, match="must share one dtype"):
        delta_rule(q, k, v.half(), beta=beta, g=g)
    with pytest.raises(ValueError, match="B == 1"):
        delta_rule(q, k, v, beta=beta, g=g, cu_seqlens=torch.tensor([0, 10]))
    q1, k1, v1, b1, g1 = (x[:1] for x in (q, k, v, beta, g))
    for bad in ([1, 10], [0, 6, 4, 10], [0, 5, 9]):
        with pytest.raises(ValueError, match="cu_seqlens must start at 0, never decrease"):
            delta_rule(q1, k1, v1, beta=b1, g=g1, cu_seqlens=torch.tensor(bad))
    with pytest.raises(ValueError, match="initial_state must have shape"):
        delta_rule(q1, k1, v1, beta=b1, g=g1, cu_seqlens=torch.tensor([0, 4, 10]),
                   initial_state=torch.zeros(1, 2, 8, 8))
    with pytest.raises(ValueError, match="unknown backend"):
        delta_rule(q, k, v, beta=beta, g=g, backend="cuda")
    with pytest.raises(ValueError, match="step: expected state"):
        delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta=beta[:, 0], g=g[:, 0], state=torch.zeros(2, 2, 8, 4))


# ---------------------------------------------------------------- Triton kernels (interpreter on CPU, fp32)

needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)


def _device_inputs(inputs, h0=None):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    moved = [x if x is None else x.to(dev) for x in inputs]
    return moved, (None if h0 is None else h0.to(dev))


@needs_triton
@pytest.mark.parametrize("b,t,dk,dv,decay,with_h0", [
    (2, 75, 60, 100, "weak", True),
    (1, 63, 100, 60, "strong", False),
    (1, 70, 16, 32, "zero", True),
    (2, 65, 32, 16, None, True),
    (1, 40, 16, 16, None, False),  # neither g nor h0: two absent gradients (custom op outputs must not alias)
])
def test_triton_matches_naive(b, t, dk, dv, decay, with_h0):
    inputs = make(b, t, 2, dk, dv, seed=8, decay=decay, normalize=decay != "zero")
    h0 = torch.randn(b, 2, dk, dv) if with_h0 else None
    inputs, h0 = _device_inputs(inputs, h0)
    assert_close(run("triton", inputs, h0), run("naive", inputs, h0), what="triton")


@needs_triton
def test_triton_varlen_matches_naive():
    inputs = make(1, 100, 2, 20, 12, seed=9, decay="strong")
    cu = torch.tensor([0, 1, 16, 16, 80, 100])  # lengths 1, 15, 0, 64, 20
    h0 = torch.randn(5, 2, 20, 12)
    inputs, h0 = _device_inputs(inputs, h0)
    cu = cu.to(inputs[0].device)
    assert_close(run("triton", inputs, h0, cu=cu), run("naive", inputs, h0, cu=cu), what="triton varlen")


@needs_triton
def test_triton_output_only():
    """No initial state and no final state: the backward starts from a zero state gradient."""
    inputs, _ = _device_inputs(make(1, 40, 2, 16, 16, seed=10))
    leaves = [x.clone().requires_grad_() for x in inputs]
    outs = []
    for backend in ("triton", "naive"):
        xs = [x.detach().clone().requires_grad_() for x in leaves]
        o, final = delta_rule_pos(*xs, backend=backend)
        assert final is None
        o.pow(2).sum().backward()
        outs.append([o.detach()] + [x.grad for x in xs])
    for a, ref in zip(*outs):
        assert err_ratio(a, ref) <= TOL


# ---------------------------------------------------------------- launch settings (hilo_kernels/common/launch.py)

@needs_triton
def test_triton_initial_state_wide_heads_match_naive():
    """K = 60, V = 100 (padded tiles, several V-blocks) with an initial state and strong decays: the Triton path's
    outputs and gradients against the oracle's."""
    inputs = make(2, 75, 2, 60, 100, seed=12, decay="strong")
    h0 = torch.randn(2, 2, 60, 100)
    inputs, h0 = _device_inputs(inputs, h0)
    assert_close(run("triton", inputs, h0), run("naive", inputs, h0), what="K=60 V=100")


def test_state_pass_stages():
    """The state passes' pipelining depth: 3 up to K = 128 in 16-bit (2 for fp32 tiles at K = 128); at K = 256
    wide_stages (2 by default) for 16-bit V-blocks <= 32 only (wider ones would overflow sm_90's shared memory in
    the backward pass: 238 KB at BV = 64 in bf16, 267 KB at BV = 16 in fp32), 1 when overridden to 1."""
    from hilo_kernels.common import launch_settings
    from hilo_kernels.delta_rule import triton_fwd

    stages = triton_fwd.state_stages
    assert (stages(64), stages(128), stages(128, 4), stages(256, 4, 16)) == (3, 3, 2, 1)
    assert (stages(256, 2, 16), stages(256, 2, 32), stages(256, 2, 64)) == (2, 2, 1)
    with launch_settings(delta_rule={"wide_stages": 1}):
        assert (stages(128), stages(256, 2, 16), stages(256, 2, 32), stages(256, 4, 16)) == (3, 1, 1, 1)
    assert stages(256, 2, 16) == 2


def test_grads_launch_settings():
    """The fused backward kernel's launch: 4 warps, 3 stages and no register cap by default; the launch settings'
    grads_warps / grads_stages / grads_maxnreg override them."""
    from hilo_kernels.common import launch_settings
    from hilo_kernels.delta_rule import triton_bwd

    assert triton_bwd.grads_launch() == {"num_warps": 4, "num_stages": 3}
    with launch_settings(delta_rule={"grads_maxnreg": 128, "grads_stages": 2}):
        assert triton_bwd.grads_launch() == {"num_warps": 4, "num_stages": 2, "maxnreg": 128}
    assert triton_bwd.grads_launch() == {"num_warps": 4, "num_stages": 3}


def test_state_pass_v_block_floor():
    """The state passes' smallest V-block: 16 up to K = 128 and 32 past it by default (GDN's K = 256 heads measured
    22% faster fwd+bwd with 32 on the H200); state_bv_min overrides it at every K (16 at the least)."""
    from hilo_kernels.common import launch_settings
    from hilo_kernels.common.launch import delta_rule_state_bv_floor as floor

    assert (floor(64), floor(128), floor(129), floor(256)) == (16, 16, 32, 32)
    for val, want in ((32, 32), (16, 16), (8, 16)):
        with launch_settings(delta_rule={"state_bv_min": val}):
            assert (floor(128), floor(256)) == (want, want)


@needs_triton
def test_triton_fp16_path():
    """The 16-bit code path (16-bit dot operands and dU, hi/lo prepare products) on fp16 inputs (the interpreter
    cannot run bf16) against the fp32 oracle on the same values: fp16 rounding-level error ratios."""
    inputs = make(1, 150, 2, 32, 32, seed=13)
    inputs = [x if x is None else x.half().float() for x in inputs]  # values exactly representable in fp16
    h0 = torch.randn(3, 2, 32, 32)
    cu = torch.tensor([0, 1, 16, 150])
    inputs, h0 = _device_inputs(inputs, h0)
    cu = cu.to(inputs[0].device)
    ref = run("naive", inputs, h0, cu=cu)
    half = [x if x is None or i == 4 else x.half() for i, x in enumerate(inputs)]  # g stays fp32
    got = run("triton", half, h0, cu=cu)
    assert_close(got, ref, tol=2e-3, what="fp16")


def test_padded_small_heads_equal_unpadded():
    """The zero-padding that CUDA applies to heads narrower than 32 (hilo_kernels.delta_rule.delta_rule_triton_padded) is
    exact: outputs, final state and every gradient equal the chunked path on the unpadded heads."""
    from hilo_kernels.common import error_ratio
    from hilo_kernels.delta_rule import delta_rule_triton_padded

    gen = torch.Generator().manual_seed(5)
    b, t, h, dk, dv = 2, 75, 2, 16, 12
    x = [torch.randn(b, t, h, d, generator=gen) for d in (dk, dk, dv)]
    x[1] = torch.nn.functional.normalize(x[1], dim=-1)
    x += [torch.rand(b, t, h, generator=gen), -torch.rand(b, t, h, generator=gen) * 0.3,
          torch.randn(b, h, dk, dv, generator=gen)]
    x, _ = _device_inputs(x)  # the Triton kernels run on CUDA, or on CPU under the interpreter
    outs = {}
    for name in ("padded", "torch"):
        leaves = [a.clone().requires_grad_() for a in x]
        q, k, v, beta, g, h0 = leaves
        if name == "padded":
            o, s = delta_rule_triton_padded(q, k, v, beta, g, dk ** -0.5, h0, True, None)
        else:
            o, s = delta_rule(q, k, v, beta=beta, g=g, initial_state=h0, output_final_state=True, backend="torch")
        grads = torch.autograd.grad((o * o).sum() + (s * s).sum(), leaves)
        outs[name] = [o, s, *grads]
    assert outs["padded"][0].shape == (b, t, h, dv) and outs["padded"][1].shape == (b, h, dk, dv)
    for a, r in zip(outs["padded"], outs["torch"]):
        assert error_ratio(a, r) < 1e-5


@needs_triton
def test_triton_custom_op_compiles_into_one_graph():
    """The Triton path is the torch.library op "hilo::delta_rule": torch.compile traces it as one node (fullgraph),
    an initial state and the final state included, with eager's values and gradients."""
    gen = torch.Generator().manual_seed(22)
    q = torch.randn(2, 70, 2, 16, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(2, 70, 2, 16, generator=gen), dim=-1)
    v = torch.randn(2, 70, 2, 8, generator=gen)
    beta = torch.rand(2, 70, 2, generator=gen)
    g = -torch.rand(2, 70, 2, generator=gen) * 0.3
    h0 = torch.randn(2, 2, 16, 8, generator=gen)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    leaves = [x.to(dev).requires_grad_() for x in (q, k, v, beta, g, h0)]

    def f(q, k, v, beta, g, h0):
        o, ht = delta_rule(q * 2, k, v, beta=beta, g=g, initial_state=h0, output_final_state=True, backend="triton")
        return o.float().square().sum() + ht.square().sum()

    assert_one_graph_with_eager_values(f, leaves, "delta_rule")



# ---------------------------------------------------------------- value heads wider than 256 (up to 512)

WITH_TRITON = ["naive", "torch", pytest.param("triton", marks=needs_triton)]


@pytest.mark.parametrize("backend", WITH_TRITON[1:])
@pytest.mark.parametrize("b,t,dk,dv,bounds", [
    (2, 75, 32, 320, None),
    (1, 130, 48, 300, [0, 1, 16, 80, 130]),  # lengths 1, 15, 64, 50
])
def test_wide_value_heads_match_naive(backend, b, t, dk, dv, bounds):
    """V > 256 (the delta rule takes up to 512: Gated DeltaNet's K = 256, V = 512 in one call): the chunked path and
    the Triton kernels (several V-blocks in every launch) against the oracle, with an initial state."""
    inputs = make(b, t, 2, dk, dv, seed=30, decay="strong")
    h0 = torch.randn(b if bounds is None else len(bounds) - 1, 2, dk, dv, generator=torch.Generator().manual_seed(31))
    cu = None if bounds is None else torch.tensor(bounds)
    if backend == "triton":
        inputs, h0 = _device_inputs(inputs, h0)
        cu = None if cu is None else cu.to(inputs[0].device)
    assert_close(run(backend, inputs, h0, cu=cu), run("naive", inputs, h0, cu=cu), what=f"{backend} V={dv}")


@pytest.mark.parametrize("backend", WITH_TRITON)
def test_head_dim_limits_are_per_operator(backend):
    """The delta rule takes K up to 256 and V up to 512 on every backend; past them the error names the operator,
    the limits and the fix. Operators without wide-V kernels (linear_attn) keep V <= 256."""
    from hilo_kernels import linear_attn

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, beta, g = (x.to(dev) for x in make(1, 3, 1, 8, 513, seed=32))
    with pytest.raises(ValueError, match=r"delta_rule: head dims must be in 1\.\.256 for K and 1\.\.512 for V, got "
                                         r"K=8, V=513; run wider value heads in column blocks of at most 512"):
        delta_rule(q, k, v, beta=beta, g=g, backend=backend)
    wide_k = torch.randn(1, 3, 1, 257, device=dev)
    with pytest.raises(ValueError, match=r"delta_rule: head dims must be in 1\.\.256 for K .* got K=257, V=8; "
                                         r"K > 256 is not supported"):
        delta_rule(wide_k, wide_k, v[..., :8], beta=beta, g=g, backend=backend)
    with pytest.raises(ValueError, match=r"linear_attn: head dims must be in 1\.\.256 for K and 1\.\.256 for V, got "
                                         r"K=8, V=300"):
        linear_attn(q, k, v[..., :300], g=g, backend=backend)
    o, final = delta_rule(q, k, v[..., :512], beta=beta, g=g, output_final_state=True, backend=backend)
    assert o.shape == (1, 3, 1, 512) and final.shape == (1, 1, 8, 512)
