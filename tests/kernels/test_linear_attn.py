"""linear_attn: naive oracle vs a closed form, torch chunk path and Triton (interpreter, fp32) vs the oracle for
outputs, final states and every gradient; varlen isolation, step == forward, input errors."""

import os

import pytest
import torch
from compile_checks import assert_one_graph_with_eager_values
from graph_checks import assert_no_per_chunk_selects
from in_order import linear_attn_pos

from hilo_kernels import linear_attn
from hilo_kernels.common import error_ratio
from hilo_kernels.linear_attn import linear_attn_step

TOL = 1e-4
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make(b, t, h, dk, dv, decay, seed=0, n_state=None, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, dk, generator=gen, dtype=torch.float64)
    k = torch.randn(b, t, h, dk, generator=gen, dtype=torch.float64)
    v = torch.randn(b, t, h, dv, generator=gen, dtype=torch.float64)
    if decay == "strong":
        g = -torch.rand(b, t, h, generator=gen, dtype=torch.float64) * 3.0
    elif decay == "weak":
        g = -torch.rand(b, t, h, generator=gen, dtype=torch.float64) * 0.02
    elif decay == "zero":
        g = torch.zeros(b, t, h, dtype=torch.float64)
    else:
        g = None
    h0 = None if n_state is None else torch.randn(n_state, h, dk, dv, generator=gen, dtype=torch.float64)
    cast = (lambda x: None if x is None else x.to(device=device, dtype=dtype))
    return cast(q), cast(k), cast(v), None if g is None else g.to(device=device, dtype=torch.float32), cast(h0) if (
        h0 is None or dtype != torch.float64) else h0.to(device)


@pytest.mark.parametrize("packed", [False, True])
def test_chunk_loop_is_linear_in_chunks(packed):
    """The chunked path's state loop takes per-chunk views once: fixed-length rows (a step per chunk of a row, all
    rows at once) and packed documents (cu_seqlens: a step per chunk of the table)."""
    def forward(t):
        q, k, v, g, _ = make(1 if packed else 3, t, 2, 8, 4, "weak", seed=5)
        cu = torch.tensor([0, t // 3, t // 2, t]) if packed else None
        o, s = linear_attn_pos(*(x.requires_grad_() for x in (q, k, v, g)), output_final_state=True, cu_seqlens=cu,
                           backend="torch")
        return o.sum() + s.sum()

    assert_no_per_chunk_selects(forward, 64 * 2, 64 * 6)


def run(q, k, v, g, h0, backend, cu=None, dtype=None, with_final=True, seed=1, do=None, dfinal=None):
    """Forward and the gradients of sum(o * do) + sum(final * dfinal) (random cotangents from `seed` unless
    given); q, k, v are cast to `dtype` leaves, g and h0 to fp32 (float64 with float64)."""
    dtype = dtype or q.dtype
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    gl = None if g is None else g.detach().to(wide).requires_grad_()
    hl = None if h0 is None else h0.detach().to(wide).requires_grad_()
    o, s = linear_attn_pos(*leaves, gl, initial_state=hl, output_final_state=with_final, cu_seqlens=cu,
                       backend=backend)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64) if do is None else do
    loss = (o * do.to(o)).sum()
    if with_final:
        dfinal = torch.randn(s.shape, generator=gen, dtype=torch.float64) if dfinal is None else dfinal
        loss = loss + (s * dfinal.to(s)).sum()
    inputs = leaves + [x for x in (gl, hl) if x is not None]
    grads = torch.autograd.grad(loss, inputs)
    return o, s, grads


def assert_close(got, ref, tol=TOL, what=""):
    o1, s1, g1 = got
    o2, s2, g2 = ref
    assert error_ratio(o1, o2) <= tol, f"{what} o: {error_ratio(o1, o2)}"
    if s2 is not None:
        assert error_ratio(s1, s2) <= tol, f"{what} final state: {error_ratio(s1, s2)}"
    names = ["dq", "dk", "dv", "dg/dh0", "dh0"]
    for name, a, b in zip(names, g1, g2):
        assert error_ratio(a, b) <= tol, f"{what} {name}: {error_ratio(a, b)}"


def closed_form(q, k, v, g, h0, scale):
    """o_t = scale * (sum_{s<=t} exp(G_t - G_s) (q_t . k_s) v_s + exp(G_t) q_t h0): independent of the code."""
    q, k, v = (x.double() for x in (q, k, v))
    b, t, h, _ = q.shape
    big_g = torch.zeros(b, t, h, dtype=torch.float64) if g is None else g.double().cumsum(1)
    diff = big_g[:, :, None, :] - big_g[:, None, :, :]  # [b, t, s, h]
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None, :, :, None]
    w = torch.where(mask, diff, torch.full_like(diff, float("-inf"))).exp()
    o = scale * torch.einsum("btsh,bthk,bshk,bshv->bthv", w, q, k, v)
    if h0 is not None:
        o = o + scale * torch.einsum("bth,bthk,bhkv->bthv", big_g.exp(), q, h0.double())
    return o


@pytest.mark.parametrize("decay", ["strong", "none"])
def test_naive_matches_closed_form(decay):
    q, k, v, g, h0 = make(2, 37, 2, 12, 20, decay, n_state=2, dtype=torch.float64)
    o, _ = linear_attn(q, k, v, g=g, initial_state=h0, backend="naive")
    assert error_ratio(o, closed_form(q, k, v, g, h0, 12 ** -0.5)) < 1e-12


@pytest.mark.parametrize(
    "b,t,h,dk,dv,decay,init",
    [
        (2, 63, 2, 60, 100, "strong", True),
        (1, 75, 3, 16, 16, "weak", False),
        (2, 130, 2, 32, 48, "zero", True),
        (1, 500, 2, 100, 100, "weak", True),
        (1, 64, 1, 8, 8, "none", False),
    ],
)
def test_torch_matches_naive(b, t, h, dk, dv, decay, init):
    q, k, v, g, h0 = make(b, t, h, dk, dv, decay, n_state=b if init else None)
    ref = run(q, k, v, g, h0, "naive", dtype=torch.float64)
    got = run(q, k, v, g, h0, "torch")
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert_close(got, ref, what=f"torch T={t}")


def varlen_case(backend, dk=16, dv=24, seed=3, lens=(1, 15, 0, 70, 40, 1)):
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    t = int(cu[-1])
    q, k, v, g, h0 = make(1, t, 2, dk, dv, "weak", seed=seed, n_state=len(lens),
                          device=DEV if backend == "triton" else "cpu")
    cu = cu.to(q.device)
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(1, t, 2, dv, generator=gen, dtype=torch.float64)
    dfinal = torch.randn(len(lens), 2, dk, dv, generator=gen, dtype=torch.float64)
    got = run(q, k, v, g, h0, backend, cu=cu, do=do, dfinal=dfinal)
    # the reference: each document run on its own (no leakage across boundaries)
    parts = []
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if s == e:  # an empty document passes its initial state through
            empty = [q.new_zeros(1, 0, 2, d) for d in (dk, dk, dv)] + [q.new_zeros(1, 0, 2)]
            parts.append((q.new_zeros(1, 0, 2, dv), h0[n:n + 1].double(), empty + [dfinal[n:n + 1].to(q.device)]))
            continue
        parts.append(run(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], h0[n:n + 1], "naive", dtype=torch.float64,
                         do=do[:, s:e], dfinal=dfinal[n:n + 1]))
    ref = (torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 0),
           [torch.cat([p[2][i] for p in parts], 0 if i == 4 else 1) for i in range(5)])
    assert_close(got, ref, what=f"{backend} varlen")


def test_torch_varlen_matches_per_document():
    varlen_case("torch", dk=60, dv=100)


def test_g_none_equals_zero_gate():
    q, k, v, g, h0 = make(1, 70, 2, 16, 16, "zero", n_state=1)
    a, sa = linear_attn(q, k, v, g=g, initial_state=h0, output_final_state=True, backend="torch")
    b, sb = linear_attn(q, k, v, g=None, initial_state=h0, output_final_state=True, backend="torch")
    assert error_ratio(a, b) < 1e-6 and error_ratio(sa, sb) < 1e-6
    assert sa.shape == (1, 2, 16, 16)


def test_step_matches_forward():
    q, k, v, g, h0 = make(2, 20, 2, 12, 10, "weak", n_state=2)
    o, s = linear_attn(q, k, v, g=g, initial_state=h0, output_final_state=True, backend="naive")
    state = h0.clone()
    for t in range(20):
        ot, state = linear_attn_step(q[:, t], k[:, t], v[:, t], g=g[:, t], state=state)
        assert error_ratio(ot, o[:, t]) < 1e-5
    assert error_ratio(state, s) < 1e-5
    # a prefill with the chunked path, then decoding, equals the full run
    _, s10 = linear_attn(q[:, :10], k[:, :10], v[:, :10], g=g[:, :10], initial_state=h0, output_final_state=True)
    ot, _ = linear_attn_step(q[:, 10], k[:, 10], v[:, 10], g=g[:, 10], state=s10)
    assert error_ratio(ot, o[:, 10]) < 1e-5


def test_no_final_state_and_defaults():
    q, k, v, g, _ = make(1, 10, 1, 4, 4, "weak")
    o, s = linear_attn(q, k, v, g=g)
    assert s is None and o.shape == (1, 10, 1, 4) and o.dtype == torch.float32
    o2, _ = linear_attn(q, k, v, g=g, scale=0.5 * 4 ** -0.5)
    assert error_ratio(o2, 0.5 * o) < 1e-6


def test_errors(monkeypatch):
    q, k, v, g, h0 = make(2, 8, 2, 4, 6, "weak", n_state=2)
    with pytest.raises(ValueError, match=r"4-D"):
        linear_attn(q[0], k, v, g=g)
    with pytest.raises(ValueError, match=r"same shape"):
        linear_attn(q, k[..., :3], v, g=g)
    with pytest.raises(ValueError, match=r"v must be"):
        linear_attn(q, k, v[:, :7], g=g)
    with pytest.raises(TypeError, match=r"share one dtype"):
        linear_attn(q, k.half(), v, g=g)
    with pytest.raises(TypeError, match=r"float32, float16 or bfloat16"):
        linear_attn(q.int(), k.int(), v.int(), g=g)
    with pytest.raises(ValueError, match=r"g must have shape"):
        linear_attn(q, k, v, g=g[:, :4])
    with pytest.raises(TypeError, match=r"g \(log decay\) must be float32"):
        linear_attn(q, k, v, g=g.bfloat16())
    with pytest.raises(ValueError, match=r"initial_state must have shape"):
        linear_attn(q, k, v, g=g, initial_state=h0[:1])
    with pytest.raises(ValueError, match=r"B == 1"):
        linear_attn(q, k, v, g=g, cu_seqlens=torch.tensor([0, 4, 8]))
    q1, k1, v1, g1 = (x.reshape(1, 16, *x.shape[2:]) for x in (q, k, v, g))
    for bad in ([1, 8, 16], [0, 9, 8, 16], [0, 8, 15]):
        with pytest.raises(ValueError, match=r"start at 0, never decrease and end at T=16"):
            linear_attn(q1, k1, v1, g=g1, cu_seqlens=torch.tensor(bad))
    with pytest.raises(TypeError, match=r"cu_seqlens must be a 1-D int32/int64"):
        linear_attn(q1, k1, v1, g=g1, cu_seqlens=torch.tensor([0.0, 16.0]))
    with pytest.raises(ValueError, match=r"unknown backend"):
        linear_attn(q, k, v, g=g, backend="cuda")
    if DEV == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match=r"TRITON_INTERPRET=1"):
            linear_attn(q, k, v, g=g, backend="triton")


# Triton kernels: under TRITON_INTERPRET=1 on CPU (fp32: the interpreter gets bf16 tl.dot wrong), on the GPU
# when there is one. Small shapes keep the interpreter fast.
triton_only = pytest.mark.skipif(not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")


@triton_only
@pytest.mark.parametrize(
    "b,t,h,dk,dv,decay,init",
    [
        (2, 75, 2, 16, 32, "strong", True),
        (1, 63, 2, 60, 100, "weak", True),
        (2, 63, 1, 32, 16, "zero", False),
        (1, 130, 2, 16, 16, "none", True),
        (1, 70, 2, 16, 16, "none", False),  # neither g nor h0: two absent gradients (custom op outputs must not alias)
        (1, 40, 1, 130, 20, "weak", True),  # K > 128: the K-blocked two-kernel backward
    ],
)
def test_triton_matches_naive(b, t, h, dk, dv, decay, init):
    q, k, v, g, h0 = make(b, t, h, dk, dv, decay, n_state=b if init else None, device=DEV)
    ref = run(q, k, v, g, h0, "naive", dtype=torch.float64)
    got = run(q, k, v, g, h0, "triton")
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert_close(got, ref, what=f"triton T={t} {decay}")


@triton_only
def test_triton_varlen_matches_per_document():
    varlen_case("triton", dk=16, dv=24)


@triton_only
def test_triton_without_final_state():
    q, k, v, g, h0 = make(1, 70, 2, 16, 16, "weak", n_state=1, device=DEV)
    ref = run(q, k, v, g, h0, "naive", dtype=torch.float64, with_final=False)
    got = run(q, k, v, g, h0, "triton", with_final=False)
    assert got[1] is None
    assert_close(got, ref, what="triton no final state")


@pytest.mark.parametrize(("varlen", "dv"), [(True, 24), (False, 24), (False, 80)])
@pytest.mark.parametrize("backend", ["naive", "torch", pytest.param("triton", marks=triton_only)])
def test_grouped_q_k_equal_repeated_heads(backend, varlen, dv):
    """q, k with G = 2 heads for H = 6 heads of v (Mamba-2's n_groups): the same outputs, state and v / g / h0
    gradients as q, k repeated to every head, and dq, dk the sums over each group's heads. Packed documents (the
    autograd.Function) and fixed length (the custom op); V = 80 in fp32 takes the Triton backward's two-kernel
    path (dq / dk and dv kernels), V = 24 its fused kernel: every kernel reads q, k per group."""
    dev = DEV if backend == "triton" else "cpu"
    q, k, v, g, h0 = make(2 if not varlen else 1, 150, 6, 16, dv, "weak", n_state=2, device=dev)
    qg, kg = q[:, :, ::3].contiguous(), k[:, :, ::3].contiguous()  # group i: heads 3i .. 3i + 2
    cu = torch.tensor([0, 70, 150], device=dev) if varlen else None
    full = run(qg.repeat_interleave(3, 2), kg.repeat_interleave(3, 2), v, g, h0, backend, cu=cu)
    grouped = run(qg, kg, v, g, h0, backend, cu=cu)
    assert grouped[2][0].shape == qg.shape and grouped[2][1].shape == kg.shape
    per_group = [x.unflatten(2, (2, 3)).sum(3) for x in full[2][:2]]
    assert_close((grouped[0], grouped[1], grouped[2]), (full[0], full[1], (*per_group, *full[2][2:])),
                 what=f"grouped {backend}")


def test_grouped_heads_must_divide():
    q, k, v, g, _ = make(1, 10, 6, 8, 8, "weak")
    with pytest.raises(ValueError, match="must divide"):
        linear_attn(q[:, :, :4], k[:, :, :4], v, g=g)


@triton_only
def test_triton_custom_op_compiles_into_one_graph():
    """Fixed-length calls of the Triton backend are the torch.library op "hilo::linear_attn": torch.compile traces
    them as one node (fullgraph), grouped q / k, an initial state and the final state included, with eager's values
    and gradients."""
    gen = torch.Generator().manual_seed(21)
    q, k = (torch.randn(2, 70, 2, 16, generator=gen) for _ in range(2))
    v = torch.randn(2, 70, 4, 8, generator=gen)
    g = -torch.rand(2, 70, 4, generator=gen) * 0.3
    h0 = torch.randn(2, 4, 16, 8, generator=gen)
    leaves = [x.to(DEV).requires_grad_() for x in (q, k, v, g, h0)]

    def f(q, k, v, g, h0):
        o, ht = linear_attn(torch.nn.functional.silu(q), k * 2, v, g=g, initial_state=h0, output_final_state=True,
                            backend="triton")
        return o.float().square().sum() + ht.square().sum()

    assert_one_graph_with_eager_values(f, leaves, "linear_attn")


@triton_only
def test_split_scores_keep_16bit_rounding_low():
    """16-bit inputs: the output kernel multiplies its intra-chunk scores into v as two 16-bit halves, so the
    forward's error against float64 on the same (fp16-exact) values is that of the split scores: in fp16 under the
    interpreter (which cannot multiply bf16) 2.5e-4 here, where one rounded copy of the scores gave 3.1e-4."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 200, 2, 32, generator=gen).half().double() for _ in range(3))
    g = -0.05 * torch.rand(1, 200, 2, generator=gen)
    ref, _ = linear_attn(q, k, v, g=g.double(), backend="naive")
    o, _ = linear_attn_pos(*(x.half().to(DEV) for x in (q, k, v)), g.to(DEV), backend="triton")
    assert error_ratio(o.double().cpu(), ref) < 2.8e-4


def test_state_blocks_narrow_on_small_grids():
    """The sequential state kernels' tiles: 64x64 on grids of 256+ programs, then 64x32, then 32x32 (no further), so
    that few sequence-heads still fill the GPU; small head dims keep their own power of two."""
    from hilo_kernels.linear_attn.triton_fwd import state_blocks

    assert state_blocks(128, 64, 128) == (64, 64)  # 128 sequence-heads x 2 tiles
    assert state_blocks(128, 128, 32) == (64, 32)  # 16K x 2, H = 16
    assert state_blocks(128, 128, 16) == (32, 32)  # 32K x 1, H = 16
    assert state_blocks(128, 128, 1) == (32, 32)
    assert state_blocks(16, 24, 1) == (16, 32)


def test_segment_count_rule():
    """state_segments: None (the default) none on a grid of one program a multiprocessor or more or a walk under 512
    chunks, else as many as fit the programs in one wave of 6 blocks a multiprocessor, none under 16 chunks; 1 none;
    n, n, every segment non-empty."""
    from hilo_kernels.common import launch_settings
    from hilo_kernels.linear_attn import triton_fwd

    count = triton_fwd.segment_count
    assert count(256, 256, 132) == 1 and count(512, 132, 132) == 1  # 16K x 2, H = 16; a full grid
    assert count(512, 64, 132) == 12 and count(512, 128, 132) == 6  # 32K x 1 at H = 4 and 8
    assert count(511, 64, 132) == 1 and count(256, 128, 132) == 1  # 16K x 1 at H = 8: a walk too short to pay
    assert count(512, 64, 264) == 24 and count(1024, 16, 132) == 49  # 49: cdiv(1024, 49) = 21 chunks a segment
    assert count(1024, 128, 132) == 6
    with launch_settings(linear_attn={"state_segments": 1}):
        assert count(1024, 16, 132) == 1
    with launch_settings(linear_attn={"state_segments": 4}):
        assert count(5, 8) == 3 and count(1, 8) == 1  # 5 chunks: 2 + 2 + 1
    assert count(1024, 16, 132) == 49


@triton_only
@pytest.mark.parametrize("segments", [2, 3])
@pytest.mark.parametrize("decay,n_state", [("strong", 2), ("weak", None), (None, 2)])
def test_segmented_state_walks_keep_the_values(segments, decay, n_state):
    """state_segments=n: the sequential state kernels (forward and backward) walk each sequence's
    chunks as n segments side by side, each carried into the next through its own contribution: the same output,
    final state and gradients (dq, dk, dv, dg, dh0) as one walk, with and without decay and initial state, 5 chunks
    of a 300-token sequence (the last one partial)."""
    from hilo_kernels.common import launch_settings
    from hilo_kernels.linear_attn import triton_fwd

    q, k, v, g, h0 = make(2, 300, 2, 24, 40, decay, n_state=n_state, device=DEV)
    want = run(q, k, v, g, h0, "triton")
    with launch_settings(linear_attn={"state_segments": segments}):
        lay = triton_fwd.Layout(2, 300, 2, None, "cpu")
        assert triton_fwd.segments(24, 40, lay, 32, 32, DEV)[1] == segments
        got = run(q, k, v, g, h0, "triton")
    assert_close(got, want, what=f"{segments} segments", tol=1e-5)


@triton_only
@pytest.mark.parametrize("decay", ["strong", "weak", None])
def test_segmented_state_walks_on_packed_documents(decay):
    """Packed documents (cu_seqlens) in segments sized by the longest a document could be (620 tokens: 10 chunks,
    4 segments of 3): the 400-token document walks 3, the shorter ones 1, their other segments' programs idle; the
    same values as one walk each, with per-document initial states."""
    from hilo_kernels.common import launch_settings
    from hilo_kernels.linear_attn import triton_fwd

    q, k, v, g, h0 = make(1, 620, 2, 24, 40, decay, n_state=4, device=DEV)
    cu = torch.tensor([0, 1, 70, 470, 620], device=DEV)
    want = run(q, k, v, g, h0, "triton", cu=cu)
    with launch_settings(linear_attn={"state_segments": 4}):
        assert triton_fwd.segments(24, 40, triton_fwd.Layout(1, 620, 2, cu, DEV), 32, 32, DEV) == (3, 4)
        got = run(q, k, v, g, h0, "triton", cu=cu)
    assert_close(got, want, what="packed, 4 segments", tol=1e-5)


@triton_only
@pytest.mark.parametrize("tiles", [{"state_bk": 16, "state_bv": 16}, {"state_bv": 16, "state_warps": 2, "state_stages": 3},
                                   {"state_bk": 32, "state_bv": 64, "out_warps": 8, "out_stages": 3, "bwd_warps": 4,
                                        "bwd_stages": 2}])
def test_state_tile_settings_keep_the_values(tiles):
    """The launch settings' state_bk / state_bv retile the sequential state kernels (forward and backward) without
    changing a value: every output and gradient as with the default tiles, on packed documents with an initial
    state (the launch settings ride along: the interpreter ignores warps and stages, the GPU tests do not)."""
    from hilo_kernels.common import launch_settings
    from hilo_kernels.linear_attn import triton_fwd

    q, k, v, g, h0 = make(1, 150, 2, 48, 40, "weak", n_state=3, device=DEV)
    cu = torch.tensor([0, 1, 70, 150], device=DEV)
    want = run(q, k, v, g, h0, "triton", cu=cu)
    default_tiles = triton_fwd.state_blocks(48, 40, 2)
    with launch_settings(linear_attn=tiles):
        assert triton_fwd.state_blocks(48, 40, 2) != default_tiles
        got = run(q, k, v, g, h0, "triton", cu=cu)
    assert triton_fwd.state_blocks(48, 40, 2) == default_tiles
    assert_close(got, want, what=str(tiles), tol=1e-5)

