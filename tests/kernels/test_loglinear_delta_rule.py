"""loglinear_delta_rule: the O(T^2) definition (float64) vs the binary-carry recurrence vs the chunked WY path vs the
Triton level scan (interpreter on CPU, fp32) for outputs, final per-level states and every gradient (q, k, v, beta,
g, level_scales, initial levels); varlen with short and empty documents; continuing from a final state; lambda == 1
is delta_rule; the decode step equals the forward with a state of bit_length(t) + 1 levels; input errors."""

import os

import pytest
import torch
import torch.nn.functional as F
from in_order import delta_rule_pos, loglinear_delta_rule_pos, loglinear_delta_rule_step_pos

from hilo_kernels import loglinear_delta_rule
from hilo_kernels.common import error_ratio
from hilo_kernels.loglinear_attn import LogLinearState, num_levels
from hilo_kernels.loglinear_delta_rule import loglinear_delta_rule_quadratic

TOL = 1e-4
SCALE = 0.3
H, DK, DV = 2, 12, 10  # non-powers of two: the Triton kernels mask their padded tiles
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
DEV = "cuda" if torch.cuda.is_available() else "cpu"
triton_only = pytest.mark.skipif(not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
NAMES = ("q", "k", "v", "beta", "g", "lam")


def make(b, t, seed, decay="mid", nl=None, unit_k=True, dk=DK, dv=DV):
    gen = torch.Generator().manual_seed(seed)
    x = {name: torch.randn(b, t, H, d, generator=gen, dtype=torch.float64)
         for name, d in (("q", dk), ("k", dk), ("v", dv))}
    if unit_k:
        x["k"] = F.normalize(x["k"], dim=-1)
    else:
        x["k"] = x["k"] * 0.3
    x["beta"] = torch.rand(b, t, H, generator=gen, dtype=torch.float64)
    rate = {"strong": 3.0, "mid": 0.5, "weak": 0.02, "zero": 0.0}[decay]
    x["g"] = -torch.rand(b, t, H, generator=gen, dtype=torch.float64) * rate
    x["lam"] = torch.rand(b, t, H, nl or num_levels(t), generator=gen, dtype=torch.float64) + 0.25
    return x


def prior_state(tokens, nl, seed, dk=DK, dv=DV):
    """A random LogLinearState (zero levels where tokens == 0)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.tensor(tokens, dtype=torch.int64)
    levels = torch.randn(len(tokens), H, nl, dk, dv, generator=gen, dtype=torch.float64)
    return LogLinearState(levels * (tokens > 0)[:, None, None, None, None], tokens)


def run(backend, x, cu=None, init=None, dtype=torch.float32, seed=1):
    """Forward with `backend` ("quadratic", "naive", "torch", "triton") and the gradients of
    sum(o * do) + sum(levels * dl) with respect to q, k, v, beta, g, level_scales (and the initial levels)."""
    dev = DEV if backend == "triton" else "cpu"
    leaves = [x[n].detach().to(dev, dtype).requires_grad_() for n in NAMES]
    cu = None if cu is None else cu.to(dev)
    prior = None
    if init is not None:
        prior = LogLinearState(init.levels.detach().to(dev, dtype).requires_grad_(), init.tokens.to(dev))
        leaves.append(prior.levels)
    if backend == "quadratic":
        n = leaves[0].shape[0] if cu is None else len(cu) - 1
        starts = [0] * n if init is None else init.tokens.tolist()
        o, levels = loglinear_delta_rule_quadratic(*leaves[:6], SCALE, prior, True, cu, starts)
    else:
        o, state = loglinear_delta_rule_pos(*leaves[:6], scale=SCALE, initial_state=prior, output_final_state=True,
                                        cu_seqlens=cu, backend=backend)
        levels = state.levels
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o)
    dl = torch.randn(levels.shape, generator=gen, dtype=torch.float64).to(levels)
    grads = torch.autograd.grad((o * do).sum() + (levels * dl).sum(), leaves, allow_unused=True)
    grads = [torch.zeros_like(x) if d is None else d for x, d in zip(leaves, grads)]
    return o.cpu(), levels.cpu(), [d.cpu() for d in grads]


def assert_close(got, ref, what):
    names = ["o", "final levels", "dq", "dk", "dv", "dbeta", "dg", "dlevel_scales", "dinitial levels"]
    for name, a, b in zip(names, [got[0], got[1], *got[2]], [ref[0], ref[1], *ref[2]]):
        err = error_ratio(a, b)
        assert err <= TOL, f"{what} {name}: error ratio {err}"


# T = 130 crosses 128 (chunk level 2), 300 reaches chunk level 3; 64 and 128 are powers of two. The recurrent
# form's gradients are checked where it is cheap (its backward is T sequential steps).
@pytest.mark.parametrize("t,decay,unit_k,recurrent_grads", [(1, "mid", True, True), (63, "weak", True, True),
                                                            (64, "zero", True, False),
                                                            (75, "strong", False, True),
                                                            (128, "mid", True, False), (130, "mid", False, False),
                                                            (300, "mid", True, False)])
def test_forms_agree(t, decay, unit_k, recurrent_grads):
    x = make(2, t, seed=t, decay=decay, unit_k=unit_k)
    ref = run("quadratic", x, dtype=torch.float64)
    assert_close(run("torch", x), ref, f"chunk T={t}")
    if recurrent_grads:
        assert_close(run("naive", x), ref, f"recurrent T={t}")
    else:
        o, st = loglinear_delta_rule_pos(*(x[n].float() for n in NAMES), scale=SCALE, output_final_state=True,
                                     backend="naive")
        assert error_ratio(o, ref[0]) <= TOL and error_ratio(st.levels, ref[1]) <= TOL


def test_varlen_short_documents_and_initial_state():
    lengths = [1, 15, 0, 75, 1, 130]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = make(1, int(cu[-1]), seed=7, nl=num_levels(130 + 130))
    init = prior_state([0, 5, 3, 64, 100, 130], nl=x["lam"].shape[-1], seed=8)
    for prior in (None, init):
        ref = run("quadratic", x, cu=cu, init=prior, dtype=torch.float64)
        assert_close(run("torch", x, cu=cu, init=prior), ref, f"chunk varlen prior={prior is not None}")
    o, st = loglinear_delta_rule_pos(*(x[n].float() for n in NAMES), scale=SCALE,
                                 initial_state=LogLinearState(init.levels.float(), init.tokens),
                                 output_final_state=True, cu_seqlens=cu, backend="naive")
    assert error_ratio(o, ref[0]) <= TOL and error_ratio(st.levels, ref[1]) <= TOL, "recurrent varlen with prior"
    o_all, _, _ = run("torch", x, cu=cu)
    o_one, _, _ = run("torch", {n: x[n][:, 16:91] for n in x})
    assert error_ratio(o_all[:, 16:91], o_one) <= TOL


def test_batch_rows_at_different_positions():
    x = make(3, 70, seed=3, nl=9)
    init = prior_state([0, 37, 129], nl=9, seed=4)
    ref = run("quadratic", x, init=init, dtype=torch.float64)
    assert_close(run("torch", x, init=init), ref, "chunk rows with their own start")


@pytest.mark.parametrize("split", [45, 64, 130, 131])
def test_continuation_from_final_state(split):
    x = {n: val.float() for n, val in make(2, 200, seed=11).items()}
    o, full = loglinear_delta_rule_pos(*(x[n] for n in NAMES), output_final_state=True)
    _, mid = loglinear_delta_rule_pos(*(x[n][:, :split] for n in NAMES), output_final_state=True)
    assert mid.tokens.tolist() == [split, split]
    o2, end = loglinear_delta_rule_pos(*(x[n][:, split:] for n in NAMES), initial_state=mid, output_final_state=True)
    assert error_ratio(o2, o[:, split:]) <= TOL
    assert error_ratio(end.levels, full.levels) <= TOL
    assert end.tokens.tolist() == [200, 200]


@pytest.mark.parametrize("backend", ["torch", "naive"])
def test_unit_level_scales_is_delta_rule(backend):
    lengths = [1, 15, 130, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = {n: val.float() for n, val in make(1, int(cu[-1]), seed=5, nl=num_levels(200 + 64)).items()}
    ones = torch.ones_like(x["lam"])
    init = prior_state([0, 9, 40, 200], nl=ones.shape[-1], seed=6)
    init = LogLinearState(init.levels.float(), init.tokens)
    args = [x[n] for n in NAMES[:5]]
    o, st = loglinear_delta_rule_pos(*args, ones, initial_state=init, output_final_state=True, cu_seqlens=cu,
                                 backend=backend)
    ob, sb = delta_rule_pos(*args, initial_state=init.levels.sum(2), output_final_state=True, cu_seqlens=cu,
                        backend=backend)
    assert error_ratio(o, ob) <= TOL
    assert error_ratio(st.levels.sum(2), sb) <= TOL
    o3, _ = loglinear_delta_rule_pos(*args, x["lam"], cu_seqlens=cu, backend=backend)
    assert error_ratio(o3, ob) > 1e-2


def test_decode_step_equals_forward_and_state_grows_logarithmically():
    t = 75
    x = {n: val.float() for n, val in make(2, t, seed=13, nl=12).items()}
    prefix = make(1, 37, seed=14, nl=12)
    _, st1 = loglinear_delta_rule_pos(*(prefix[n].float() for n in NAMES), output_final_state=True)
    init = LogLinearState(torch.cat([torch.zeros_like(st1.levels), st1.levels], 0), torch.tensor([0, 37]))
    o_ref, final_ref = loglinear_delta_rule_pos(*(x[n] for n in NAMES), initial_state=init, output_final_state=True)
    alone = LogLinearState.empty(1, H, DK, DV)
    both = LogLinearState(init.levels[:, :, : num_levels(37)], init.tokens)
    for i in range(t):
        alone = alone.grow(num_levels(i + 1))
        both = both.grow(num_levels(int(both.tokens.max()) + 1))
        assert alone.levels.shape[2] == i.bit_length() + 1 and both.levels.shape[2] == (37 + i).bit_length() + 1
        step = [x[n][:, i] for n in NAMES]
        o, both = loglinear_delta_rule_step_pos(*step, both)
        o0, alone = loglinear_delta_rule_step_pos(*(z[:1] for z in step), alone)
        assert error_ratio(o, o_ref[:, i]) <= TOL, f"step {i}"
        assert error_ratio(o0, o_ref[:1, i]) <= TOL, f"step {i} alone"
        occupied = (alone.levels[0].abs().amax(dim=(0, 2, 3)) > 0).tolist()
        assert occupied == [True] + [bool(i >> (lv - 1) & 1) for lv in range(1, len(occupied))]
    assert both.tokens.tolist() == [t, 37 + t] and alone.tokens.tolist() == [t]
    assert both.levels.shape[2] == num_levels(37 + t) < 12
    assert error_ratio(both.levels, final_ref.levels[:, :, : both.levels.shape[2]]) <= TOL
    assert final_ref.levels[:, :, both.levels.shape[2]:].abs().max() == 0


# Triton level scan (interpreter on CPU): T = 75 ends in chunk 1 (one chunk level), 300 in chunk 4 (three chunk
# levels, a padded fourth column of the stacked state), 64 exactly one chunk (no level scan).
@triton_only
@pytest.mark.parametrize("t,decay,unit_k", [(64, "zero", True), (75, "strong", False), (300, "mid", True)])
def test_triton_matches_definition(t, decay, unit_k):
    x = make(2, t, seed=t, decay=decay, unit_k=unit_k)
    ref = run("quadratic", x, dtype=torch.float64)
    assert_close(run("triton", x), ref, f"triton T={t}")


@triton_only
def test_triton_varlen_short_documents_and_initial_state():
    lengths = [1, 15, 0, 75, 1, 130]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = make(1, int(cu[-1]), seed=7, nl=num_levels(130 + 130))
    init = prior_state([0, 5, 3, 64, 100, 130], nl=x["lam"].shape[-1], seed=8)
    for prior in (None, init):
        ref = run("quadratic", x, cu=cu, init=prior, dtype=torch.float64)
        assert_close(run("triton", x, cu=cu, init=prior), ref, f"triton varlen prior={prior is not None}")


def test_compiled_glue_failure_names_the_eager_option(monkeypatch):
    """A glue that torch.compile cannot build fails with an error naming HILO_LOGLINEAR_DELTA_GLUE=eager."""
    from hilo_kernels.loglinear_delta_rule import triton_bwd

    def broken_backend(gm, example_inputs):
        raise RuntimeError("this backend builds nothing")

    monkeypatch.setattr(triton_bwd, "GLUE_BACKEND", broken_backend)
    monkeypatch.setattr(triton_bwd, "_COMPILED_GLUE", {})
    torch._dynamo.reset()
    before, _ = triton_bwd._glue_functions("compiled")
    x = torch.randn(5, 2, 4)
    with pytest.raises(RuntimeError, match="HILO_LOGLINEAR_DELTA_GLUE=eager runs the glue without it") as err:
        before(x, x, x, x[..., :1], x[..., :1], x, torch.arange(5), 1, 0.5)  # 5 tokens in one chunk row
    assert isinstance(err.value.__cause__, torch._dynamo.exc.BackendCompilerFailed), err.value.__cause__


@triton_only
def test_triton_rows_at_different_positions_and_no_gate():
    x = make(3, 70, seed=3, nl=9)
    init = prior_state([0, 37, 129], nl=9, seed=4)
    ref = run("quadratic", x, init=init, dtype=torch.float64)
    assert_close(run("triton", x, init=init), ref, "triton rows with their own start")
    args = [x[n].float().to(DEV) for n in NAMES]
    args[4] = None
    o, st = loglinear_delta_rule_pos(*args, output_final_state=True, backend="triton")
    cpu = [None if a is None else a.cpu() for a in args]
    cpu[4] = torch.zeros(3, 70, H)
    o_ref, st_ref = loglinear_delta_rule_pos(*cpu, output_final_state=True, backend="torch")
    assert error_ratio(o.cpu(), o_ref) <= TOL and error_ratio(st.levels.cpu(), st_ref.levels) <= TOL


@triton_only
def test_triton_unit_level_scales_is_delta_rule():
    lengths = [1, 15, 200, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]).to(DEV)
    x = {n: val.float().to(DEV) for n, val in make(1, int(cu[-1]), seed=5, nl=num_levels(200)).items()}
    args = [x[n] for n in NAMES[:5]]
    o, st = loglinear_delta_rule_pos(*args, torch.ones_like(x["lam"]), output_final_state=True, cu_seqlens=cu,
                                 backend="triton")
    ob, sb = delta_rule_pos(*args, output_final_state=True, cu_seqlens=cu, backend="torch")
    assert error_ratio(o, ob) <= TOL
    assert error_ratio(st.levels.sum(2), sb) <= TOL


@triton_only
def test_padded_narrow_values_equal_unpadded(monkeypatch):
    """The zero-padding of value heads narrower than PADDED_VALUE_DIM that CUDA applies
    (hilo_kernels.loglinear_delta_rule.loglinear_delta_rule_triton_padded) is exact: packed documents with an initial
    state give the definition's outputs, final levels and every gradient; the padded kernels ran on 32 columns."""
    import importlib

    ops = importlib.import_module("hilo_kernels.loglinear_delta_rule")  # the package (kernels exports the function)
    bwd = importlib.import_module("hilo_kernels.loglinear_delta_rule.triton_bwd")

    widths = []
    unpadded = bwd.loglinear_delta_rule_triton

    def recording(q, k, v, *args):
        widths.append(v.shape[-1])
        return unpadded(q, k, v, *args)

    monkeypatch.setattr(bwd, "loglinear_delta_rule_triton", recording)
    lengths = [15, 75, 130]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = make(1, int(cu[-1]), seed=9, nl=num_levels(130 + 64))
    init = prior_state([0, 5, 64], nl=x["lam"].shape[-1], seed=10)
    ref = run("quadratic", x, cu=cu, init=init, dtype=torch.float64)
    leaves = [x[n].detach().to(DEV, torch.float32).requires_grad_() for n in NAMES]
    prior = LogLinearState(init.levels.to(DEV, torch.float32).requires_grad_(), init.tokens.to(DEV))
    o, levels = ops.loglinear_delta_rule_triton_padded(*leaves, SCALE, prior, True, cu.to(DEV), init.tokens.tolist())
    assert widths == [ops.PADDED_VALUE_DIM] and o.shape[-1] == DV and levels.shape[-1] == DV
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o)
    dl = torch.randn(levels.shape, generator=gen, dtype=torch.float64).to(levels)
    grads = torch.autograd.grad((o * do).sum() + (levels * dl).sum(), [*leaves, prior.levels])
    assert_close((o.cpu(), levels.cpu(), [d.cpu() for d in grads]), ref, "padded values")


def test_scaled_fp16_pieces():
    """scaled_fp16: rows 1e-30 .. 1e30 (far outside fp16's range) come back within fp16's rounding of their largest
    entry, their fp16 values peak in [2^14, 2^15), the scales are powers of two, zero rows stay zero and inf stays
    inf; zcols is scaled by column the same way; the scans get such copies only with pieces16 and 16-bit inputs."""
    from hilo_kernels.common import launch_settings
    from hilo_kernels.loglinear_delta_rule import triton_bwd
    from hilo_kernels.loglinear_delta_rule.triton_fwd import scaled_fp16

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 5, 8, generator=gen) * torch.logspace(-30, 30, 15).reshape(3, 5, 1)
    x[0, 0] = 0.0
    x[1, 1, 3] = float("inf")
    vals, sc = scaled_fp16(x)
    assert vals.dtype == torch.float16 and sc.shape == x.shape[:-1]
    assert torch.all(torch.frexp(sc)[0] == 0.5)
    rec = vals.float() * sc[..., None]
    finite = torch.isfinite(x).all(-1) & (x.abs().amax(-1) > 0)
    err = (rec - x).abs().amax(-1)
    assert torch.all(err[finite] <= x.abs().amax(-1)[finite] * 2.0**-11)
    peak = vals.float().abs().amax(-1)[finite]
    assert torch.all((peak >= 2.0**14) & (peak < 2.0**15))
    assert torch.all(rec[0, 0] == 0) and rec[1, 1, 3] == float("inf")
    pieces = [torch.randn(2, 3, 4, 8, generator=gen) for _ in range(3)]
    # zcols [H, rows, K, C]: a scale per column (token), its columns ranging over 60 orders of magnitude
    zcols = torch.randn(2, 3, 8, 4, generator=gen) * torch.logspace(-30, 30, 4)
    with launch_settings(loglinear_delta_rule={"pieces16": True}):
        got, scales = triton_bwd._scan_pieces(*pieces, zcols, torch.bfloat16)
    assert all(p.dtype == torch.float16 for p in got) and len(scales) == 4
    assert got[3].shape == zcols.shape and got[3].is_contiguous() and scales[3].shape == (2, 3, 4)
    zrec = got[3].float() * scales[3][..., None, :]
    assert torch.all((zrec - zcols).abs() <= zcols.abs().amax(-2, keepdim=True) * 2.0**-11)
    pieces = [*pieces, zcols]
    with launch_settings(loglinear_delta_rule={"pieces16": True}):
        assert triton_bwd._scan_pieces(*pieces, torch.float32)[1] is None  # fp32 inputs: exact fp32 products
    assert triton_bwd._scan_pieces(*pieces, torch.bfloat16)[1] is None  # K = 8: fp32 pieces by default


def assert_fp16_close(x, scale, what):
    """The Triton path on fp16 q, k, v, beta against the fp32 chunked path on the same fp16 values (the comparison is
    of the arithmetic, not of the inputs' rounding): output (kept fp16), final levels and every gradient within
    the 16-bit tolerances of docs/kernels.md."""
    outs = {}
    for backend, dtype in (("torch", torch.float32), ("triton", torch.float16)):
        dev = DEV if backend == "triton" else "cpu"
        leaves = [x[n].to(torch.float16 if n in ("q", "k", "v", "beta") else torch.float32).to(
            dev, dtype if n in ("q", "k", "v", "beta") else torch.float32).requires_grad_() for n in NAMES]
        o, st = loglinear_delta_rule_pos(*leaves, scale=scale, output_final_state=True, backend=backend)
        gen = torch.Generator().manual_seed(1)
        do = torch.randn(o.shape, generator=gen).to(o)
        dl = torch.randn(st.levels.shape, generator=gen).to(st.levels)
        grads = torch.autograd.grad((o.float() * do).sum() + (st.levels * dl).sum(), leaves)
        outs[backend] = [o.cpu(), st.levels.cpu(), *(d.cpu() for d in grads)]
    assert outs["triton"][0].dtype == torch.float16
    names = ["o", "final levels", "dq", "dk", "dv", "dbeta", "dg", "dlevel_scales"]
    tols = [5e-3, 5e-3, 1e-2, 1e-2, 1e-2, 1e-2, 2e-2, 2e-2]
    for name, tol, a, b in zip(names, tols, outs["triton"], outs["torch"], strict=True):
        assert error_ratio(a, b) <= tol, f"{what} {name}: {error_ratio(a, b)}"


def record_scan_launches(monkeypatch, seen):
    """Collect every level-scan launch (first state, stacked states, groups, BV) in seen["fwd"] / seen["bwd"]."""
    from hilo_kernels.loglinear_delta_rule import triton_bwd, triton_fwd

    def recorder(real, key):
        def record(*args):
            out = real(*args)
            seen.setdefault(key, []).extend(out)
            return out
        return record

    monkeypatch.setattr(triton_fwd, "scan_launches", recorder(triton_fwd.scan_launches, "fwd"))
    monkeypatch.setattr(triton_bwd, "scan_launches", recorder(triton_bwd.scan_launches, "bwd"))


@triton_only
@pytest.mark.parametrize("pieces16,stages", [(None, None), (True, 1), (True, 2)])
def test_triton_half_inputs(pieces16, stages):
    """fp16 q, k, v, beta (bf16 needs a GPU: the interpreter's bf16 tl.dot is wrong) against the fp32 chunked path on
    the same values, at the bf16 tolerances of docs/kernels.md; the output keeps fp16. pieces16: the level scans read
    q_eff, W, Kd and zcols as scaled fp16 values (the default at K > 128 only); bwd_scan_stages=2 pipelines the
    backward scans' chunk loops (a launch setting the interpreter runs as written)."""
    from hilo_kernels.common import launch_settings

    x = make(1, 200, seed=24)
    x["q"] = x["q"] * 0.5
    with launch_settings(loglinear_delta_rule={"pieces16": pieces16, "bwd_scan_stages": stages}):
        assert_fp16_close(x, SCALE, "fp16")


@triton_only
def test_triton_level_groups():
    """Two chunk levels per scan program (so T = 300 after a 100-token prior splits its three chunk levels into
    groups of 2 + 1, and the delta rule's prior levels into groups of 2): the groups add up to the definition."""
    from hilo_kernels.common import launch_settings

    x = make(1, 300, seed=17, nl=num_levels(400))
    init = prior_state([100], nl=x["lam"].shape[-1], seed=18)
    ref = run("quadratic", x, init=init, dtype=torch.float64)
    with launch_settings(loglinear_delta_rule={"scan_levels": 2}):
        got = run("triton", x, init=init)
    assert_close(got, ref, "triton level groups of 2")


def test_scan_launches_keep_32_columns():
    """A level-scan program's stacked tile keeps at least 32 columns where V allows (one stacked state of 16 columns
    at K = 256 faulted on the H200): at K = 256 with scan_cols=64,scan_levels=4 (one level a program) BV becomes 32;
    the defaults' launches are unchanged."""
    from hilo_kernels.common import launch_settings
    from hilo_kernels.loglinear_attn.triton_fwd import level_layout
    from hilo_kernels.loglinear_delta_rule.triton_fwd import scan_launches

    lay = level_layout(((0, 0, 64 * 257),), (0,), 64 * 257, torch.device("cpu"))  # nine chunk levels
    assert scan_launches(lay, 0, lay.nj, 256, 512) == [(0, 2, 4, 16), (8, 1, 1, 32)]
    assert scan_launches(lay, 0, lay.nj, 128, 128) == [(0, 8, 1, 16), (8, 1, 1, 32)]
    with launch_settings(loglinear_delta_rule={"scan_cols": 64, "scan_levels": 4}):
        assert scan_launches(lay, 0, lay.nj, 256, 512) == [(0, 1, 9, 32)]
        assert scan_launches(lay, 0, lay.nj, 256, 16) == [(0, 1, 9, 16)]  # V = 16 has no wider block
    # a column budget of its own (the backward's bwd_scan_cols): 256 at K = 256 is 64 columns, one level of 32 here
    assert scan_launches(lay, 0, lay.nj, 256, 512, 256) == [(0, 2, 4, 32), (8, 1, 1, 32)]


@triton_only
def test_backward_scan_columns_of_their_own(monkeypatch):
    """The bwd_scan_cols launch setting: the backward scans launch with their own stacked columns (recorded: two
    stacked levels of BV = 16 against the forward's BV = 32 at V = 32) and the gradients still match the
    definition."""
    from hilo_kernels.common import launch_settings

    seen = {}
    record_scan_launches(monkeypatch, seen)
    x = make(1, 300, seed=19, nl=num_levels(400), dv=32)
    init = prior_state([100], nl=x["lam"].shape[-1], seed=20, dv=32)
    ref = run("quadratic", x, init=init, dtype=torch.float64)
    with launch_settings(loglinear_delta_rule={"scan_levels": 2, "scan_cols": 64, "bwd_scan_cols": 32}):
        got = run("triton", x, init=init)
    assert_close(got, ref, "backward scans with 32 columns")
    assert {(s, bv) for _, s, _, bv in seen["fwd"]} == {(2, 32), (1, 32)}
    assert {(s, bv) for _, s, _, bv in seen["bwd"]} == {(2, 16), (1, 32)}  # one level keeps 32 columns


def test_auto_scan_choices():
    """The head-size rules take the timed choices at K > 128 only: 256 stacked columns, fp16 pieces for 16-bit inputs
    and two backward stages with them; at K <= 128, or for fp32 inputs, 128 columns, fp32 pieces and one stage. A
    launch setting given by name wins at any K (fp32 inputs keep fp32 pieces whatever the setting)."""
    from hilo_kernels.common import launch_settings
    from hilo_kernels.common.launch import (
        loglinear_delta_bwd_scan_cols,
        loglinear_delta_bwd_stages,
        loglinear_delta_pieces16,
        loglinear_delta_scan_cols,
    )

    def rules(dk, dt):
        return (loglinear_delta_scan_cols(dk), loglinear_delta_bwd_scan_cols(dk), loglinear_delta_pieces16(dk, dt),
                loglinear_delta_bwd_stages(dk, dt))

    bf16, f32 = torch.bfloat16, torch.float32
    got = {(dk, dt): rules(dk, dt) for dk in (64, 128, 256) for dt in (bf16, f32)}
    assert got == {(64, bf16): (128, 128, False, 1), (128, bf16): (128, 128, False, 1),
                   (256, bf16): (256, 256, True, 2), (64, f32): (128, 128, False, 1),
                   (128, f32): (128, 128, False, 1), (256, f32): (256, 256, False, 1)}
    with launch_settings(loglinear_delta_rule={"scan_cols": 64, "pieces16": True, "bwd_scan_stages": 3}):
        assert rules(128, bf16) == (64, 64, True, 3)
        assert not loglinear_delta_pieces16(128, f32)
    with launch_settings(loglinear_delta_rule={"pieces16": False, "bwd_scan_cols": 32}):
        assert rules(256, bf16) == (256, 32, False, 1)  # 2 stages need fp16 pieces
    assert rules(256, bf16) == (256, 256, True, 2)


@triton_only
def test_auto_choices_run_at_k256(monkeypatch):
    """At K = 256 with fp16 inputs the defaults run the scans on 256 stacked columns (recorded: two stacked levels
    of BV = 32 at V = 32, against one under the 128 of K <= 128) with scaled fp16 pieces, forward and backward, the
    backward scans at two stages, within the 16-bit tolerances of the fp32 chunked path on the same values."""
    from hilo_kernels.loglinear_delta_rule import triton_bwd

    seen = {"scaled": [], "stages": []}
    record_scan_launches(monkeypatch, seen)
    real_pieces, real_scan = triton_bwd._scan_pieces, triton_bwd._delta_level_scan_bwd

    def pieces(*args):
        out = real_pieces(*args)
        seen["scaled"].append(out[1] is not None)
        return out

    class StagesRecorder:  # the backward scan's launch settings (the interpreter runs any num_stages alike)
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen["stages"].append(kwargs["num_stages"])
                return real_scan[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_bwd, "_scan_pieces", pieces)
    monkeypatch.setattr(triton_bwd, "_delta_level_scan_bwd", StagesRecorder())
    x = make(1, 130, seed=31, dk=256, dv=32)
    x["q"] = x["q"] * 0.5
    assert_fp16_close(x, 256 ** -0.5, "fp16 K = 256")
    assert {(s, bv) for _, s, _, bv in seen["fwd"]} == {(2, 32)}
    assert {(s, bv) for _, s, _, bv in seen["bwd"]} == {(2, 32)}
    assert seen["scaled"] and all(seen["scaled"])
    assert seen["stages"] and set(seen["stages"]) == {2}


def test_input_errors():
    x = {n: val.float() for n, val in make(1, 75, seed=2).items()}
    args = [x[n] for n in NAMES[:5]]
    with pytest.raises(ValueError, match="needs L >= bit_length"):
        loglinear_delta_rule_pos(*args, x["lam"][..., :6])
    with pytest.raises(ValueError, match="level_scales must have shape"):
        loglinear_delta_rule_pos(*args, x["lam"][:, :10])
    with pytest.raises(ValueError, match="unknown backend"):
        loglinear_delta_rule_pos(*args, x["lam"], backend="cuda")
    with pytest.raises(ValueError, match="beta must have shape"):
        loglinear_delta_rule(x["q"], x["k"], x["v"], beta=x["beta"][:, :10], g=x["g"], level_scales=x["lam"])
    late = LogLinearState(torch.zeros(1, H, 8, DK, DV), torch.tensor([100]))
    with pytest.raises(ValueError, match="position 174"):
        loglinear_delta_rule_pos(*args, x["lam"], initial_state=late)
    with pytest.raises(ValueError, match="state.levels must be"):
        loglinear_delta_rule_step_pos(*(x[n][:, 0] for n in NAMES), LogLinearState.empty(1, H, DK, DV + 1))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_unit_lower_inverse_values_and_gradients(backend):
    """(I + A)^{-1} of the WY form, Triton (interpreter on CPU) and torch, against float64 solves: the inverse and
    the gradient of A through the backward's two products with the inverse. One matrix has every strictly lower
    entry 1 (identical keys, beta = 1): the inverse is bidiagonal while A's powers reach C(63, 32) ~ 1e18, which a
    power-series inverse could not survive in fp32."""
    from hilo_kernels.loglinear_delta_rule.tril_inverse import unit_lower_inverse

    gen = torch.Generator().manual_seed(0)
    k = F.normalize(torch.randn(2, 3, 64, 16, generator=gen), dim=-1)
    beta = torch.rand(2, 3, 64, generator=gen)
    decay = torch.exp(-torch.rand(2, 3, 64, 64, generator=gen).tril(-1).cumsum(-2) * 0.1)
    a = beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay
    a[0, 0] = 1.0
    a = a + torch.triu(torch.randn(2, 3, 64, 64, generator=gen))  # ignored: on and above the diagonal
    dt = torch.randn(2, 3, 64, 64, generator=gen)
    leaf = a.clone().to(DEV).requires_grad_()
    t = unit_lower_inverse(leaf, backend)
    (t * dt.to(DEV)).sum().backward()
    ref_leaf = a.detach().double().requires_grad_()
    eye = torch.eye(64, dtype=torch.float64)
    ref = torch.linalg.solve_triangular(eye + torch.tril(ref_leaf, -1), eye.expand(2, 3, 64, 64), upper=False)
    (ref * dt.double()).sum().backward()
    assert error_ratio(t.cpu(), ref) <= 1e-5
    assert error_ratio(t[0, 0].cpu(), eye - torch.diag(torch.ones(63, dtype=torch.float64), -1)) <= 1e-6
    assert error_ratio(leaf.grad.cpu(), ref_leaf.grad) <= 1e-5
    assert not leaf.grad.triu().any()


def test_unit_lower_inverse_bad_inputs():
    from hilo_kernels.loglinear_delta_rule.tril_inverse import unit_lower_inverse

    with pytest.raises(ValueError, match=r"must be \[..., C, C\]"):
        unit_lower_inverse(torch.zeros(2, 64, 32))
    with pytest.raises(ValueError, match="takes C = 64"):
        unit_lower_inverse(torch.zeros(2, 32, 32), "triton")
    with pytest.raises(ValueError, match="backend must be"):
        unit_lower_inverse(torch.zeros(2, 64, 64), "cublas")


@triton_only
def test_compiled_glue_gives_the_eager_glue_values(monkeypatch):
    """HILO_LOGLINEAR_DELTA_GLUE=compiled: the pieces either side of the inverse through torch.compile(dynamic=True,
    fullgraph=True) give the eager pieces' output, final levels and every gradient, over two calls of other lengths
    (no recompilation per length; dynamo does recompile once for a single chunk row, and where a view's base
    size happens to equal another size). On CPU the backend is aot_eager (the same capture and AOT autograd, no C++
    build); the GPU runs inductor."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from hilo_kernels.loglinear_delta_rule import triton_bwd

    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(triton_bwd, "GLUE_BACKEND", counter)
    monkeypatch.setattr(triton_bwd, "_COMPILED_GLUE", {})
    torch._dynamo.reset()
    # two lengths, one compilation; the varlen and initial-state handling around the glue is the eager glue's
    cases = [(make(1, 130, seed=21), None, None), (make(1, 70, seed=22, decay="strong"), None, None)]
    for i, (x, cu_, prior) in enumerate(cases):
        monkeypatch.setenv("HILO_LOGLINEAR_DELTA_GLUE", "eager")
        ref = run("triton", x, cu=cu_, init=prior)
        monkeypatch.setenv("HILO_LOGLINEAR_DELTA_GLUE", "compiled")
        assert_close(run("triton", x, cu=cu_, init=prior), ref, f"compiled glue, case {i}")
    assert counter.frame_count == 2, counter.frame_count  # before and after the inverse, once for both lengths
    # the default, "auto": compiled for CUDA tensors, eager for CPU ones (the interpreter's tests)
    modes, pick = [], triton_bwd._glue_functions
    monkeypatch.setattr(triton_bwd, "_glue_functions", lambda mode: modes.append(mode) or pick(mode))
    monkeypatch.delenv("HILO_LOGLINEAR_DELTA_GLUE")
    run("triton", make(1, 5, seed=23))
    assert modes == ["compiled" if DEV == "cuda" else "eager"], modes
    monkeypatch.setenv("HILO_LOGLINEAR_DELTA_GLUE", "jit")
    with pytest.raises(ValueError, match="HILO_LOGLINEAR_DELTA_GLUE='jit': expected one of"):
        run("triton", make(1, 5, seed=23))


@pytest.mark.parametrize("dk", [100, 150])
def test_split_level_scan_backward_wide_heads(dk):
    """V = 40 (two V-blocks) and K = 100 in one K-block (G accumulated alone) or K = 150 (three 64-wide K-blocks: G
    and G^T slices): the backward's gradient kernels give the chunked path's gradients."""

    gen = torch.Generator().manual_seed(41)
    b, t, h, dv = 1, 200, 1, 40
    x = [torch.randn(b, t, h, dk, generator=gen), F.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1),
         torch.randn(b, t, h, dv, generator=gen), torch.rand(b, t, h, generator=gen),
         -torch.rand(b, t, h, generator=gen) * 0.02, torch.rand(b, t, h, num_levels(t), generator=gen) + 0.25]
    do = torch.randn(b, t, h, dv, generator=gen)
    results = {}
    for backend, dev in (("triton", DEV), ("torch", "cpu")):
        leaves = [z.to(dev).requires_grad_() for z in x]
        o, _ = loglinear_delta_rule_pos(*leaves, backend=backend)
        results[backend] = torch.autograd.grad((o * do.to(dev)).sum(), leaves)
    for name, got, ref in zip(NAMES, results["triton"], results["torch"], strict=True):
        assert error_ratio(got.cpu(), ref.cpu()) <= 1e-5, name


# Value heads wider than 256 (the delta rules take up to 512: Gated DeltaNet's K = 256, V = 512 in one call): every
# backend against the definition, outputs, final levels and every gradient. T = 130 reaches chunk level 2; the packed
# documents continue priors (the prior levels' scan, mode 1, and the initial levels' gradient). On the Triton path
# V = 320 and 264 are more than UNROLL_V, so the split backward's gradient kernels loop over their V-blocks (v_span).
WIDE_CASES = {"batch": {"lengths": None, "tokens": None, "dk": 32, "dv": 320},
              "varlen_prior": {"lengths": [1, 15, 40, 20], "tokens": [0, 5, 64, 100], "dk": 24, "dv": 264}}


@pytest.mark.parametrize("backend", ["naive", "torch", pytest.param("triton", marks=triton_only)])
@pytest.mark.parametrize("case", list(WIDE_CASES))
def test_wide_value_heads_match_definition(backend, case):
    lengths, tokens, dk, dv = WIDE_CASES[case].values()
    if lengths is None:
        cu, x, init = None, make(1, 130, seed=61, dk=dk, dv=dv), None
    else:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        x = make(1, int(cu[-1]), seed=62, nl=num_levels(max(lengths) + max(tokens)), dk=dk, dv=dv)
        init = prior_state(tokens, nl=x["lam"].shape[-1], seed=63, dk=dk, dv=dv)
    ref = run("quadratic", x, cu=cu, init=init, dtype=torch.float64)
    assert_close(run(backend, x, cu=cu, init=init), ref, f"{backend} {case} V={dv}")


def test_head_dim_limits():
    """V up to 512 (K up to 256); past them the error names the operator, the limits and the fix. loglinear_attn
    (no wide-V kernels) keeps V <= 256."""
    from hilo_kernels import loglinear_attn

    x = {n: val.float() for n, val in make(1, 5, seed=64, dv=513).items()}
    with pytest.raises(ValueError, match=r"loglinear_delta_rule: head dims must be in 1\.\.256 for K and 1\.\.512 "
                                         r"for V, got K=12, V=513; run wider value heads in column blocks"):
        loglinear_delta_rule_pos(*(x[n] for n in NAMES), backend="torch")
    wide_k = torch.randn(1, 5, H, 257)
    with pytest.raises(ValueError, match=r"loglinear_delta_rule: head dims .* got K=257, V=513; K > 256 is not "
                                         r"supported"):
        loglinear_delta_rule_pos(wide_k, wide_k, *(x[n] for n in NAMES[2:]), backend="naive")
    with pytest.raises(ValueError, match=r"loglinear_attn: head dims must be in 1\.\.256 for K and 1\.\.256 for V"):
        loglinear_attn(x["q"], x["k"], x["v"][..., :300], g=x["g"], level_scales=x["lam"], backend="torch")
    o, st = loglinear_delta_rule_pos(*(x[n] for n in NAMES[:2]), x["v"][..., :512], *(x[n] for n in NAMES[3:]),
                                 output_final_state=True, backend="torch")
    assert o.shape == (1, 5, H, 512) and st.levels.shape[-2:] == (12, 512)
