"""loglinear_attn: the O(T^2) definition (float64) vs the binary-carry recurrence vs the chunked path vs the Triton
kernels (interpreter on CPU, fp32) for outputs, final per-level states and every gradient (q, k, v, g,
level_scales, initial levels); varlen with short and empty documents; continuing from a final state; lambda == 1 is
linear_attn; the decode step equals the forward with a state of bit_length(t) + 1 levels; input errors."""

import os

import pytest
import torch
from compile_checks import assert_one_graph_with_eager_values
from graph_checks import assert_no_per_chunk_selects
from in_order import loglinear_attn_pos, loglinear_attn_step_pos

from hilo_kernels import linear_attn, loglinear_attn
from hilo_kernels.common import error_ratio
from hilo_kernels.loglinear_attn import LogLinearState, loglinear_attn_quadratic, num_levels

TOL = 1e-4
SCALE = 0.3
H, DK, DV = 2, 12, 10  # non-powers of two: the Triton kernels mask their padded tiles
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
DEV = "cuda" if torch.cuda.is_available() else "cpu"
triton_only = pytest.mark.skipif(not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")


def make(b, t, seed, decay="mid", nl=None):
    gen = torch.Generator().manual_seed(seed)
    x = {name: torch.randn(b, t, H, d, generator=gen, dtype=torch.float64)
         for name, d in (("q", DK), ("k", DK), ("v", DV))}
    rate = {"strong": 3.0, "mid": 0.5, "weak": 0.02, "zero": 0.0}[decay]
    x["g"] = -torch.rand(b, t, H, generator=gen, dtype=torch.float64) * rate
    x["lam"] = torch.rand(b, t, H, nl or num_levels(t), generator=gen, dtype=torch.float64) + 0.25
    return x


def prior_state(tokens, nl, seed):
    """A random LogLinearState (zero levels where tokens == 0)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.tensor(tokens, dtype=torch.int64)
    levels = torch.randn(len(tokens), H, nl, DK, DV, generator=gen, dtype=torch.float64)
    return LogLinearState(levels * (tokens > 0)[:, None, None, None, None], tokens)


def test_chunk_loop_is_linear_in_chunks():
    def forward(t):
        x = make(1, t, seed=6)
        o, state = loglinear_attn_pos(*(x[n].float().requires_grad_() for n in ("q", "k", "v", "g", "lam")),
                                      scale=SCALE, output_final_state=True, backend="torch")
        return o.sum() + state.levels.sum()

    assert_no_per_chunk_selects(forward, 64 * 3, 64 * 9)


def run(backend, x, cu=None, init=None, dtype=torch.float32, seed=1):
    """Forward with `backend` ("quadratic", "naive", "torch", "triton") and the gradients of
    sum(o * do) + sum(levels * dl) with respect to q, k, v, g, level_scales (and the initial levels)."""
    dev = DEV if backend == "triton" else "cpu"
    leaves = [x[n].detach().to(dev, dtype).requires_grad_() for n in ("q", "k", "v", "g", "lam")]
    cu = None if cu is None else cu.to(dev)
    prior = None
    if init is not None:
        prior = LogLinearState(init.levels.detach().to(dev, dtype).requires_grad_(), init.tokens.to(dev))
        leaves.append(prior.levels)
    q, k, v, g, lam = leaves[:5]
    if backend == "quadratic":
        n = q.shape[0] if cu is None else len(cu) - 1
        starts = [0] * n if init is None else init.tokens.tolist()
        o, levels = loglinear_attn_quadratic(q, k, v, g, lam, SCALE, prior, True, cu, starts)
    else:
        o, state = loglinear_attn(q, k, v, g=g, level_scales=lam, scale=SCALE, initial_state=prior,
                                  output_final_state=True, cu_seqlens=cu, backend=backend)
        levels = state.levels
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o)
    dl = torch.randn(levels.shape, generator=gen, dtype=torch.float64).to(levels)
    grads = torch.autograd.grad((o * do).sum() + (levels * dl).sum(), leaves, allow_unused=True)
    grads = [torch.zeros_like(x) if d is None else d for x, d in zip(leaves, grads)]
    return o.cpu(), levels.cpu(), [d.cpu() for d in grads]


def assert_close(got, ref, what):
    names = ["o", "final levels", "dq", "dk", "dv", "dg", "dlevel_scales", "dinitial levels"]
    for name, a, b in zip(names, [got[0], got[1], *got[2]], [ref[0], ref[1], *ref[2]]):
        err = error_ratio(a, b)
        assert err <= TOL, f"{what} {name}: error ratio {err}"


# T = 130 crosses 128 (chunk level 2), 300 reaches chunk level 3; 64 and 128 are powers of two. The recurrent
# form's gradients are checked where it is cheap (its backward is T sequential steps).
@pytest.mark.parametrize("t,decay,recurrent_grads", [(1, "mid", True), (63, "weak", True), (64, "zero", False),
                                                     (75, "strong", True), (128, "mid", False),
                                                     (130, "mid", False), (300, "mid", False)])
def test_forms_agree(t, decay, recurrent_grads):
    x = make(2, t, seed=t, decay=decay)
    ref = run("quadratic", x, dtype=torch.float64)
    assert_close(run("torch", x), ref, f"chunk T={t}")
    if recurrent_grads:
        assert_close(run("naive", x), ref, f"recurrent T={t}")
    else:
        o, st = loglinear_attn_pos(*(x[n].float() for n in ("q", "k", "v", "g", "lam")), scale=SCALE,
                               output_final_state=True, backend="naive")
        assert error_ratio(o, ref[0]) <= TOL and error_ratio(st.levels, ref[1]) <= TOL


def test_varlen_short_documents_and_initial_state():
    lengths = [1, 15, 0, 75, 1, 130]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = make(1, int(cu[-1]), seed=7, nl=num_levels(130 + 130))
    init = prior_state([0, 5, 3, 64, 100, 130], nl=x["lam"].shape[-1], seed=8)
    for prior in (None, init):
        ref = run("quadratic", x, cu=cu, init=prior, dtype=torch.float64)
        assert_close(run("torch", x, cu=cu, init=prior), ref, f"chunk varlen prior={prior is not None}")
    o, st = loglinear_attn_pos(*(x[n].float() for n in ("q", "k", "v", "g", "lam")), scale=SCALE,
                           initial_state=LogLinearState(init.levels.float(), init.tokens), output_final_state=True,
                           cu_seqlens=cu, backend="naive")
    assert error_ratio(o, ref[0]) <= TOL and error_ratio(st.levels, ref[1]) <= TOL, "recurrent varlen with prior"
    # Documents are independent: the 75-token document alone gives the same output.
    o_all, _, _ = run("torch", x, cu=cu)
    alone = {n: x[n][:, 16:91] for n in x}
    o_one, _, _ = run("torch", alone)
    assert error_ratio(o_all[:, 16:91], o_one) <= TOL


def test_batch_rows_at_different_positions():
    x = make(3, 70, seed=3, nl=9)
    init = prior_state([0, 37, 129], nl=9, seed=4)
    ref = run("quadratic", x, init=init, dtype=torch.float64)
    assert_close(run("torch", x, init=init), ref, "chunk rows with their own start")


@pytest.mark.parametrize("split", [45, 64, 130, 131])
def test_continuation_from_final_state(split):
    x = {n: val.float() for n, val in make(2, 200, seed=11).items()}
    o, full = loglinear_attn(x["q"], x["k"], x["v"], g=x["g"], level_scales=x["lam"], output_final_state=True)
    head = {n: val[:, :split] for n, val in x.items()}
    tail = {n: val[:, split:] for n, val in x.items()}
    _, mid = loglinear_attn(head["q"], head["k"], head["v"], g=head["g"], level_scales=head["lam"],
                            output_final_state=True)
    assert mid.tokens.tolist() == [split, split]
    o2, end = loglinear_attn(tail["q"], tail["k"], tail["v"], g=tail["g"], level_scales=tail["lam"], initial_state=mid,
                             output_final_state=True)
    assert error_ratio(o2, o[:, split:]) <= TOL
    assert error_ratio(end.levels, full.levels) <= TOL
    assert end.tokens.tolist() == [200, 200]


@pytest.mark.parametrize("backend", ["torch", "naive"])
def test_unit_level_scales_is_linear_attn(backend):
    lengths = [1, 15, 130, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = {n: val.float() for n, val in make(1, int(cu[-1]), seed=5, nl=num_levels(200 + 64)).items()}
    ones = torch.ones_like(x["lam"])
    init = prior_state([0, 9, 40, 200], nl=ones.shape[-1], seed=6)
    init = LogLinearState(init.levels.float(), init.tokens)
    o, st = loglinear_attn(x["q"], x["k"], x["v"], g=x["g"], level_scales=ones, initial_state=init,
                           output_final_state=True, cu_seqlens=cu, backend=backend)
    ob, sb = linear_attn(x["q"], x["k"], x["v"], g=x["g"], initial_state=init.levels.sum(2), output_final_state=True,
                         cu_seqlens=cu, backend=backend)
    assert error_ratio(o, ob) <= TOL
    assert error_ratio(st.levels.sum(2), sb) <= TOL
    # Non-unit scales change the output (the comparison above is not vacuous).
    o3, _ = loglinear_attn(x["q"], x["k"], x["v"], g=x["g"], level_scales=x["lam"], cu_seqlens=cu, backend=backend)
    assert error_ratio(o3, ob) > 1e-2


def test_decode_step_equals_forward_and_state_grows_logarithmically():
    t = 75
    x = {n: val.float() for n, val in make(2, t, seed=13, nl=12).items()}
    prefix = make(1, 37, seed=14, nl=12)
    _, st1 = loglinear_attn_pos(*(prefix[n].float() for n in ("q", "k", "v", "g", "lam")), output_final_state=True)
    init = LogLinearState(torch.cat([torch.zeros_like(st1.levels), st1.levels], 0), torch.tensor([0, 37]))
    o_ref, final_ref = loglinear_attn(x["q"], x["k"], x["v"], g=x["g"], level_scales=x["lam"], initial_state=init,
                                      output_final_state=True)
    # Row 0 decodes from an empty one-level state; rows 0 and 1 (at positions i and 37 + i) decode together.
    alone = LogLinearState.empty(1, H, DK, DV)
    both = LogLinearState(init.levels[:, :, : num_levels(37)], init.tokens)
    for i in range(t):
        alone = alone.grow(num_levels(i + 1))
        both = both.grow(num_levels(int(both.tokens.max()) + 1))
        assert alone.levels.shape[2] == i.bit_length() + 1 and both.levels.shape[2] == (37 + i).bit_length() + 1
        step = [x[n][:, i] for n in ("q", "k", "v", "g", "lam")]
        o, both = loglinear_attn_step_pos(*step, both)
        o0, alone = loglinear_attn_step_pos(*(z[:1] for z in step), alone)
        assert error_ratio(o, o_ref[:, i]) <= TOL, f"step {i}"
        assert error_ratio(o0, o_ref[:1, i]) <= TOL, f"step {i} alone"
        # Level l >= 1 is occupied iff bit l-1 of the position is set.
        occupied = (alone.levels[0].abs().amax(dim=(0, 2, 3)) > 0).tolist()
        assert occupied == [True] + [bool(i >> (lv - 1) & 1) for lv in range(1, len(occupied))]
    assert both.tokens.tolist() == [t, 37 + t] and alone.tokens.tolist() == [t]
    assert both.levels.shape[2] == num_levels(37 + t) < 12
    assert error_ratio(both.levels, final_ref.levels[:, :, : both.levels.shape[2]]) <= TOL
    assert final_ref.levels[:, :, both.levels.shape[2]:].abs().max() == 0


# Triton kernels (interpreter on CPU): T = 75 ends in chunk 1 (one chunk level), 300 in chunk 4 (three chunk levels,
# a padded fourth column of the stacked state), 64 exactly one chunk (no level scan).
@triton_only
@pytest.mark.parametrize("t,decay", [(64, "zero"), (75, "strong"), (300, "mid")])
def test_triton_matches_definition(t, decay):
    x = make(2, t, seed=t, decay=decay)
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


@triton_only
def test_triton_rows_at_different_positions_and_no_gate():
    x = make(3, 70, seed=3, nl=9)
    init = prior_state([0, 37, 129], nl=9, seed=4)
    ref = run("quadratic", x, init=init, dtype=torch.float64)
    assert_close(run("triton", x, init=init), ref, "triton rows with their own start")
    qkv = [x[n].float().to(DEV) for n in ("q", "k", "v")]
    lam = x["lam"].float().to(DEV)
    o, st = loglinear_attn_pos(*qkv, None, lam, output_final_state=True, backend="triton")
    o_ref, st_ref = loglinear_attn_pos(*(z.cpu() for z in qkv), torch.zeros(3, 70, H), lam.cpu(),
                                   output_final_state=True, backend="torch")
    assert error_ratio(o.cpu(), o_ref) <= TOL and error_ratio(st.levels.cpu(), st_ref.levels) <= TOL


@triton_only
def test_triton_unit_level_scales_is_linear_attn():
    lengths = [1, 15, 200, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]).to(DEV)
    x = {n: val.float().to(DEV) for n, val in make(1, int(cu[-1]), seed=5, nl=num_levels(200)).items()}
    ones = torch.ones_like(x["lam"])
    o, st = loglinear_attn(x["q"], x["k"], x["v"], g=x["g"], level_scales=ones, output_final_state=True, cu_seqlens=cu,
                           backend="triton")
    ob, sb = linear_attn(x["q"], x["k"], x["v"], g=x["g"], output_final_state=True, cu_seqlens=cu, backend="torch")
    assert error_ratio(o, ob) <= TOL
    assert error_ratio(st.levels.sum(2), sb) <= TOL


@triton_only
def test_triton_half_inputs():
    """fp16 q, k, v (bf16 needs a GPU: the interpreter's bf16 tl.dot is wrong) against the fp32 chunked path on the
    same values, at the bf16 tolerances of docs/kernels.md."""
    x = make(1, 200, seed=21)
    outs = {}
    for backend, dtype in (("torch", torch.float32), ("triton", torch.float16)):
        dev = DEV if backend == "triton" else "cpu"
        leaves = [x[n].to(dev, dtype if n in "qkv" else torch.float32).requires_grad_() for n in ("q", "k", "v", "g",
                                                                                                  "lam")]
        o, st = loglinear_attn_pos(*leaves, scale=SCALE, output_final_state=True, backend=backend)
        gen = torch.Generator().manual_seed(1)
        do = torch.randn(o.shape, generator=gen).to(o)
        dl = torch.randn(st.levels.shape, generator=gen).to(st.levels)
        grads = torch.autograd.grad((o.float() * do).sum() + (st.levels * dl).sum(), leaves)
        outs[backend] = [o.cpu(), st.levels.cpu(), *(d.cpu() for d in grads)]
    assert outs["triton"][0].dtype == torch.float16
    names = ["o", "final levels", "dq", "dk", "dv", "dg", "dlevel_scales"]
    tols = [5e-3, 5e-3, 1e-2, 1e-2, 1e-2, 2e-2, 2e-2]
    for name, tol, a, b in zip(names, tols, outs["triton"], outs["torch"]):
        assert error_ratio(a, b) <= tol, f"fp16 {name}: {error_ratio(a, b)}"


@triton_only
@pytest.mark.parametrize("split", [False, True])
def test_triton_many_chunk_levels(split):
    """The node tree, its gradient kernels as one or as two, on documents of 13 and 9 chunks, the second continuing
    a 200-token prior (its chunks start at absolute index 3, so node ranges are clipped at the document's first
    chunk), with a strong gate on one and a weak one on the other head of the same rows."""
    from hilo_kernels.common import launch_settings

    x = make(1, 1390, seed=31, decay="weak", nl=num_levels(200 + 560))
    x["g"][..., 0] *= 60.0
    cu = torch.tensor([0, 830, 1390])
    init = prior_state([0, 200], nl=x["lam"].shape[-1], seed=32)
    ref = run("quadratic", x, cu=cu, init=init, dtype=torch.float64)
    with launch_settings(loglinear_attn={"node_grads_split": split}):
        got = run("triton", x, cu=cu, init=init)
    assert_close(got, ref, f"triton split={split}")


def test_node_grads_split_follows_head_size():
    """By default the node form's gradient kernels split at 4 warps for heads up to K = 128, V = 64 (timed at
    log-linear Mamba-2's heads) and stay one kernel at 8 warps above; a launch setting given by name wins."""
    from hilo_kernels.common import launch_settings
    from hilo_kernels.loglinear_attn.triton_nodes import grads_split

    cases = ((16, 8), (128, 64), (100, 60), (128, 128), (256, 32))
    want = [(True, 4), (True, 4), (True, 4), (False, 8), (False, 8)]
    assert [grads_split(dk, dv) for dk, dv in cases] == want
    with launch_settings(loglinear_attn={"node_grads_split": False}):
        assert grads_split(128, 64) == (False, 4)
    with launch_settings(loglinear_attn={"node_grads_split": True, "node_grads_warps": 8}):
        assert grads_split(128, 64) == (True, 8) and grads_split(128, 128) == (True, 8)
    assert [grads_split(dk, dv) for dk, dv in cases] == want


@triton_only
def test_node_grads_default_launch(monkeypatch):
    """With the defaults at small heads the backward launches the two halves at 4 warps (recorded), and the result
    still matches the definition."""
    from hilo_kernels.loglinear_attn import triton_nodes

    seen = []

    class Recorder:
        def __init__(self, real):
            self.real = real

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((self.real.__name__, kwargs["num_warps"]))
                return self.real[grid](*args, **kwargs)
            return launch

    for name in ("_grads", "_grads_read", "_grads_write"):
        monkeypatch.setattr(triton_nodes, name, Recorder(getattr(triton_nodes, name)))
    x = make(1, 64 * 5 + 3, seed=35, nl=num_levels(64 * 5 + 3))
    ref = run("quadratic", x, dtype=torch.float64)
    assert_close(run("triton", x), ref, "node form, default gradient kernels")
    assert set(seen) == {("_grads_read", 4), ("_grads_write", 4)}


def test_input_errors():
    x = {n: val.float() for n, val in make(1, 75, seed=2).items()}
    args = (x["q"], x["k"], x["v"], x["g"])
    with pytest.raises(ValueError, match="needs L >= bit_length"):
        loglinear_attn_pos(*args, x["lam"][..., :6])
    with pytest.raises(ValueError, match="level_scales must have shape"):
        loglinear_attn_pos(*args, x["lam"][:, :10])
    with pytest.raises(ValueError, match="unknown backend"):
        loglinear_attn_pos(*args, x["lam"], backend="cuda")
    with pytest.raises(TypeError, match="LogLinearState"):
        loglinear_attn_pos(*args, x["lam"], initial_state=torch.zeros(1, H, DK, DV))
    bad = LogLinearState(torch.ones(1, H, 8, DK, DV), torch.tensor([0]))
    with pytest.raises(ValueError, match="tokens == 0"):
        loglinear_attn_pos(*args, x["lam"], initial_state=bad)
    late = LogLinearState(torch.zeros(1, H, 8, DK, DV), torch.tensor([100]))
    with pytest.raises(ValueError, match="position 174"):
        loglinear_attn_pos(*args, x["lam"], initial_state=late)


def test_node_form_final_states_when_no_sequence_ends_on_a_chunk_level():
    """A single chunk after a 128-token prior (chunk index 2 = 0b10 reads level 2, whose range, chunks 0-1, is all
    prior): no final node exists, so the listed final nodes (bf16 storage keeps them apart) are an empty tensor, and
    the final chunk-level states must come out zero, not fail to index it."""
    from hilo_kernels.loglinear_attn.triton_fwd import level_layout
    from hilo_kernels.loglinear_attn.triton_nodes import final_from_nodes, node_tables

    lay = level_layout(((0, 0, 40),), (128,), 40, torch.device("cpu"))
    tab = node_tables(lay)
    assert lay.nj == 2 and tab.final_list.numel() == 0
    empty = torch.zeros(0, H, DK, DV)
    for listed in (True, False):
        out = final_from_nodes(empty, lay, tab, None, listed=listed)
        assert out.shape == (1, H, 2, DK, DV) and not out.any()


@triton_only
@pytest.mark.parametrize("t", [70, 300])
def test_triton_custom_op_without_states(t):
    """Fixed-length calls with neither an initial nor a final state (training's) are the torch.library op
    "hilo::loglinear_attn": its values and gradients against the definition, and one node of a fullgraph compile."""
    x = make(2, t, seed=t + 5)
    names = ("q", "k", "v", "g", "lam")
    leaves = [x[n].float().to(DEV).requires_grad_() for n in names]
    o = loglinear_attn_pos(*leaves, scale=0.3, backend="triton")[0]
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(2)).to(o)
    grads = torch.autograd.grad((o * do).sum(), leaves)
    ref_leaves = [x[n].double().requires_grad_() for n in names]
    starts = [0, 0]
    ref = loglinear_attn_quadratic(*ref_leaves, 0.3, None, False, None, starts)[0]
    ref_grads = torch.autograd.grad((ref * do.cpu().double()).sum(), ref_leaves)
    assert error_ratio(o.cpu(), ref) <= TOL
    for name, a, r in zip(names, grads, ref_grads, strict=True):
        assert error_ratio(a.cpu(), r) <= TOL, name

    def f(q, k, v, g, lam):
        return loglinear_attn(q * 2, k, v, g=g, level_scales=lam, scale=0.3, backend="triton")[0].square().sum()

    if t == 70:  # the graph does not depend on T; at 300 the interpreter's two more passes only cost time
        assert_one_graph_with_eager_values(f, leaves, "loglinear_attn", rtol=1e-4, atol=1e-5)
