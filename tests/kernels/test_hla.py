"""HLA family (docs/kernels.md): index-sum definition == masked matrices == token recurrence ("naive") == linear_attn
composition ("torch", and "triton" under the interpreter) == one-pass chunked hla2 == exclusive associative scan
== the fused Triton kernels (hla2, ahla; outputs, states and every gradient);
gradients against autograd of the masked matrices; varlen, continuation, normalization, decode steps; and the
paper's wrong formulas kept as references that must differ from the masked operators."""

import os

import pytest
import torch
from in_order import ahla_pos, hla2_pos, hla3_pos

from hilo_kernels import ahla, hla2, hla3
from hilo_kernels.common import error_ratio
from hilo_kernels.hla import AHLAState, HLA2State, HLA3State, hla2_chunked, hla_masked, hla_step
from hilo_kernels.hla.scan import (
    AHLASummary,
    Summary,
    ahla_combine,
    ahla_scan,
    ahla_token_summaries,
    blelloch_exclusive_scan,
    combine,
    hla2_scan,
    token_summaries,
)
from hilo_kernels.hla.state import signed_clamp, state_shapes
from hilo_kernels.linear_attn import linear_attn

OPS = {"hla2": hla2, "ahla": ahla, "hla3": hla3}
POS = {"hla2": hla2_pos, "ahla": ahla_pos, "hla3": hla3_pos}  # g by position (in_order)
CASES = [("hla2", "d1"), ("hla2", "d2"), ("ahla", "d1"), ("hla3", "d1")]
F64 = 1e-10
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()


def make(b, t, h, dk, dv, decay, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, k = (0.5 * torch.randn(b, t, h, dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, t, h, dv, generator=gen, dtype=torch.float64)
    g = {"strong": -2.0 * torch.rand(b, t, h, generator=gen, dtype=torch.float64),
         "weak": -0.05 * torch.rand(b, t, h, generator=gen, dtype=torch.float64), None: None}[decay]
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return q.to(dtype), k.to(dtype), v.to(dtype), None if g is None else g.to(wide)


def random_state(op, n, h, dk, dvs, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    cls = {"hla2": HLA2State, "ahla": AHLAState, "hla3": HLA3State}[op]
    return cls(*(0.3 * torch.randn(s, generator=gen, dtype=torch.float64).to(dtype)
                 for s in state_shapes(op, n, h, dk, dvs).values()))


def reference(op, decay, q, k, v, g, scale=1.0, normalize=False, eps=1e-6):
    """The masked-matrix operator, normalized here independently of hilo_kernels.hla.state when asked."""
    num = hla_masked(op, q, k, v, g, decay=decay, scale=scale)
    if not normalize:
        return num
    den = hla_masked(op, q, k, torch.ones_like(v[..., :1]), g, decay=decay, scale=scale)
    return num / (torch.sign(den) + (den == 0)) / torch.maximum(den.abs(), torch.full_like(den, eps))


def index_definition(op, decay, q, k, v, g):
    """The index sums of docs/kernels.md, term by term with explicit weights (tiny T only)."""
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
    t = q.shape[1]
    a = qh @ kh.transpose(-1, -2)  # a[t, i] = q_t . k_i
    b = torch.ones(q.shape[0], q.shape[2], t, dtype=q.dtype) if g is None else g.cumsum(1).exp().transpose(1, 2)
    r = torch.arange(t)
    le = (r[:, None] <= r[None, :]).to(q.dtype)  # le[x, y] = [x <= y]
    if op == "hla3":  # indices (t, j, i, l): i <= j, l <= j, j <= t
        w = (b[..., :, None, None, None] * b[..., None, :, None, None] ** 2
             / (b[..., None, None, :, None] * b[..., None, None, :, None] * b[..., None, None, None, :]))
        mask = le.T[:, :, None, None] * le.T[None, :, :, None] * le.T[None, :, None, :]
        return torch.einsum("bhtjil,bhti,bhji,bhjl,bhlv->bthv", w * mask, a, a, a, vh)
    b0, b1, b2 = b[..., :, None, None], b[..., None, :, None], b[..., None, None, :]  # per index axis
    mask = le.T[:, :, None] * le.T[None, :, :]  # axis 2 <= axis 1 <= axis 0
    if op == "ahla":  # indices (t, i, j): weight b_t / b_j
        return torch.einsum("bhtij,bhti,bhij,bhjv->bthv", (b0 / b2) * mask, a, a, vh)
    w = (b0 / b2) * (b1 / b2) if decay == "d1" else (b0 / b2) * (b0 / b1)  # indices (t, j, i)
    return torch.einsum("bhtji,bhti,bhji,bhjv->bthv", w * mask, a, a, vh)


@pytest.mark.parametrize("op,decay", CASES)
@pytest.mark.parametrize("gate", [None, "strong"])
def test_masked_matrices_match_index_sums(op, decay, gate):
    q, k, v, g = make(2, 6, 2, 3, 2, gate, seed=1)
    assert error_ratio(hla_masked(op, q, k, v, g, decay=decay), index_definition(op, decay, q, k, v, g)) < F64


@pytest.mark.parametrize("op,decay", CASES)
@pytest.mark.parametrize("gate", [None, "strong", "weak"])
def test_all_forms_agree_float64(op, decay, gate):
    """naive recurrence == composition == masked (and for hla2: chunked one pass == exclusive scan)."""
    q, k, v, g = make(2, 37, 2, 5, 3, gate, seed=2)
    ref = hla_masked(op, q, k, v, g, decay=decay, scale=0.8)
    for backend in ("naive", "torch"):
        o, _ = POS[op](q, k, v, g, decay=decay, scale=0.8, backend=backend)
        assert error_ratio(o, ref) < F64, backend
    if op == "hla2":
        o, _ = hla2_chunked(q, k, v, g, decay=decay, scale=0.8, chunk=8)
        assert error_ratio(o, ref) < F64
        if decay == "d2" or g is None:  # the scan's decayed form is "decay every summary"
            o, _ = hla2_scan(q, k, v, g, scale=0.8, chunk=8)
            assert error_ratio(o, ref) < F64


@pytest.mark.parametrize("op,decay", CASES)
def test_odd_length_and_head_dims(op, decay):
    """T = 75 crosses linear_attn's 64-token chunks; K = 60, V = 100 (101 columns with normalize)."""
    q, k, v, g = make(1, 75, 1, 60, 100, "weak", seed=24)
    q, k = 0.3 * q, 0.3 * k
    for normalize in (False, True):
        o, _ = POS[op](q, k, v, g, decay=decay, normalize=normalize, backend="torch")
        assert error_ratio(o, reference(op, decay, q, k, v, g, normalize=normalize)) < F64, normalize
    if op == "hla2":
        o, _ = hla2_chunked(q, k, v, g, decay=decay, chunk=32)
        assert error_ratio(o, hla_masked(op, q, k, v, g, decay=decay)) < F64


def test_decay_conventions_differ_and_zero_gate_is_no_decay():
    q, k, v, g = make(1, 20, 1, 4, 3, "strong", seed=3)
    d1, _ = hla2(q, k, v, g=g, decay="d1")
    d2, _ = hla2(q, k, v, g=g, decay="d2")
    assert error_ratio(d1, d2) > 0.1
    for op, decay in CASES:
        zero, _ = POS[op](q, k, v, torch.zeros_like(g), decay=decay)
        none, _ = POS[op](q, k, v, None, decay=decay)
        assert error_ratio(zero, none) < F64


def test_scan_and_chunked_across_chunk_sizes():
    """Chunk sizes that do and do not divide T, down to single tokens (the scan then is Blelloch over tokens)."""
    q, k, v, g = make(1, 23, 2, 4, 3, "strong", seed=4)
    ref2 = hla_masked("hla2", q, k, v, g, decay="d2")
    ref1 = hla_masked("hla2", q, k, v, g, decay="d1")
    ones = hla_masked("hla2", q, k, torch.ones_like(v[..., :1]), g, decay="d2")[..., 0]
    for chunk in (1, 5, 23, 32):
        o, den = hla2_scan(q, k, v, g, chunk=chunk)
        assert error_ratio(o, ref2) < F64 and error_ratio(den, ones) < F64, chunk
        o, _ = hla2_chunked(q, k, v, g, chunk=chunk)
        assert error_ratio(o, ref1) < F64, chunk


def test_chunked_state_continuation():
    q, k, v, g = make(2, 30, 2, 4, 3, "weak", seed=5)
    h0 = random_state("hla2", 2, 2, 4, 3, seed=6)
    ref, ref_state = hla2(q, k, v, g=g, initial_state=h0, output_final_state=True, backend="naive")
    o, state = hla2_chunked(q, k, v, g, chunk=7, initial_state=h0, output_final_state=True)
    assert error_ratio(o, ref) < F64
    for a, b in zip(state, ref_state, strict=True):
        assert error_ratio(a, b) < F64


@pytest.mark.parametrize("op,decay", CASES)
def test_composition_grads_match_masked_autograd(op, decay):
    q, k, v, g = make(1, 19, 2, 4, 3, "strong", seed=7)
    gen = torch.Generator().manual_seed(8)
    do = torch.randn(1, 19, 2, 3, generator=gen, dtype=torch.float64)

    def grads(fn):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
        return torch.autograd.grad((fn(*leaves) * do).sum(), leaves)

    got = grads(lambda *x: POS[op](*x, decay=decay, scale=0.9, backend="torch")[0])
    ref = grads(lambda *x: hla_masked(op, *x, decay=decay, scale=0.9))
    for name, a, b in zip("qkvg", got, ref, strict=True):
        assert error_ratio(a, b) < 1e-9, name


@pytest.mark.parametrize("op,decay", CASES)
def test_state_grads_match_recurrence_autograd(op, decay):
    """Gradients of o and the final state w.r.t. every input and initial_state: composition vs token recurrence."""
    q, k, v, g = make(2, 11, 2, 3, 2, "weak", seed=9)
    h0 = random_state(op, 2, 2, 3, 2, seed=10)
    gen = torch.Generator().manual_seed(11)
    do = torch.randn(2, 11, 2, 2, generator=gen, dtype=torch.float64)
    dst = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in h0]

    def run(backend):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, *h0)]
        state = type(h0)(*leaves[4:])
        o, fin = POS[op](*leaves[:4], decay=decay, initial_state=state, output_final_state=True, backend=backend)
        loss = (o * do).sum() + sum((f * d).sum() for f, d in zip(fin, dst, strict=True))
        return [o, *fin], torch.autograd.grad(loss, leaves)

    (out_t, grad_t), (out_n, grad_n) = run("torch"), run("naive")
    for a, b in zip(out_t + list(grad_t), out_n + list(grad_n), strict=True):
        assert error_ratio(a, b) < 1e-9


@pytest.mark.parametrize("op,decay", CASES)
def test_varlen_matches_per_document(op, decay):
    lens = [1, 15, 7, 17]
    cu = torch.tensor([0, 1, 16, 23, 40])
    q, k, v, g = make(1, 40, 2, 4, 3, "weak", seed=12)
    h0 = random_state(op, 4, 2, 4, 3, seed=13)
    ref_o, ref_states = [], []
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        assert e - s == lens[n]
        sl = slice(s, e)
        o, st = POS[op](q[:, sl], k[:, sl], v[:, sl], g[:, sl], decay=decay, backend="naive",
                        initial_state=type(h0)(*(x[n:n + 1] for x in h0)), output_final_state=True)
        plain = hla_masked(op, q[:, sl], k[:, sl], v[:, sl], g[:, sl], decay=decay)
        zero_start, _ = POS[op](q[:, sl], k[:, sl], v[:, sl], g[:, sl], decay=decay, backend="torch")
        assert error_ratio(zero_start, plain) < F64
        ref_o.append(o)
        ref_states.append(st)
    ref_o = torch.cat(ref_o, 1)
    for backend in ("torch", "naive"):
        o, st = POS[op](q, k, v, g, decay=decay, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                        backend=backend)
        assert error_ratio(o, ref_o) < F64, backend
        for i, field in enumerate(st):
            assert error_ratio(field, torch.cat([r[i] for r in ref_states], 0)) < F64, backend
        plain, _ = POS[op](q, k, v, g, decay=decay, cu_seqlens=cu, backend=backend)
        per_doc = torch.cat([hla_masked(op, q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], decay=decay)
                             for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)], 1)
        assert error_ratio(plain, per_doc) < F64, backend


@pytest.mark.parametrize("op,decay", CASES)
@pytest.mark.parametrize("normalize", [False, True])
def test_continuation(op, decay, normalize):
    """forward(a + b) == forward(b, initial_state=forward(a).final_state), outputs against the masked form."""
    q, k, v, g = make(2, 29, 2, 4, 3, "weak", seed=14)
    if normalize:
        q, k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    kw = {"decay": decay, "normalize": normalize, "scale": 0.7, "backend": "torch"}
    full, full_state = POS[op](q, k, v, g, output_final_state=True, **kw)
    a, state_a = POS[op](q[:, :12], k[:, :12], v[:, :12], g[:, :12], output_final_state=True, **kw)
    b, state_b = POS[op](q[:, 12:], k[:, 12:], v[:, 12:], g[:, 12:], initial_state=state_a,
                         output_final_state=True, **kw)
    ref = reference(op, decay, q, k, v, g, scale=0.7, normalize=normalize)
    assert error_ratio(full, ref) < F64
    assert error_ratio(torch.cat([a, b], 1), ref) < F64
    _, naive_state = POS[op](q, k, v, g, output_final_state=True, **{**kw, "backend": "naive"})
    for x, y, z in zip(state_b, full_state, naive_state, strict=True):
        assert x.shape[-1] in (4, 3 + normalize)
        assert error_ratio(x, y) < F64 and error_ratio(x, z) < F64


def test_signed_clamp():
    x = torch.tensor([-1e-9, 0.0, 1e-9, -2.0, 3.0], dtype=torch.float64)
    assert torch.equal(signed_clamp(x, 1e-6), torch.tensor([-1e-6, 1e-6, 1e-6, -2.0, 3.0], dtype=torch.float64))


@pytest.mark.parametrize("op,decay", CASES)
def test_normalize_with_signed_clamp(op, decay):
    """Gaussian q, k give denominators of both signs: the sign is kept (dividing by |den| would fail), tiny ones
    are clamped to +-eps, and a zero query gives 0, not NaN."""
    q, k, v, g = make(1, 33, 2, 4, 3, "weak", seed=15)
    q[0, 5] = 0.0
    den = hla_masked(op, q, k, torch.ones_like(v[..., :1]), g, decay=decay)
    assert (den < 0).any() and (den > 0).any()
    eps = float(den.abs().flatten().kthvalue(4).values) * 1.5  # a few denominators fall below eps
    for backend in ("torch", "naive"):
        o, _ = POS[op](q, k, v, g, decay=decay, normalize=True, eps=eps, backend=backend)
        assert torch.isfinite(o).all() and (o[0, 5] == 0).all()
        assert error_ratio(o, reference(op, decay, q, k, v, g, normalize=True, eps=eps)) < F64, backend
        num = hla_masked(op, q, k, v, g, decay=decay)
        assert error_ratio(o, num / den.abs().clamp(min=eps)) > 0.1


@pytest.mark.parametrize("op,decay", CASES)
@pytest.mark.parametrize("normalize", [False, True])
def test_decode_steps_match_forward(op, decay, normalize):
    q, k, v, g = make(2, 17, 2, 4, 3, "weak", seed=16)
    if normalize:
        q, k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    kw = {"decay": decay, "normalize": normalize, "scale": 0.6}
    _, full_state = POS[op](q, k, v, g, output_final_state=True, **kw)
    _, state = POS[op](q[:, :6], k[:, :6], v[:, :6], g[:, :6], output_final_state=True, **kw)
    outs = []
    for t in range(6, 17):
        o, state = hla_step(op, q[:, t], k[:, t], v[:, t], g=g[:, t], state=state, **kw)
        outs.append(o)
    ref = reference(op, decay, q, k, v, g, scale=0.6, normalize=normalize)
    assert error_ratio(torch.stack(outs, 1), ref[:, 6:]) < F64
    for a, b in zip(state, full_state, strict=True):
        assert error_ratio(a, b) < F64
    fresh, _ = hla_step(op, q[:, 0], k[:, 0], v[:, 0], g=g[:, 0], state=None, **kw)  # None: the empty state
    assert error_ratio(fresh, ref[:, 0]) < F64


@pytest.mark.skipif(not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("op,decay", CASES)
def test_triton_backend_matches_float64(op, decay):
    """fp32 through linear_attn's Triton kernels (interpreter on CPU): varlen, initial/final state, every grad."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cu = torch.tensor([0, 3, 70], device=dev)  # the second document crosses a 64-token chunk boundary
    q, k, v, g = make(1, 70, 2, 8, 4, "weak", seed=17)
    h0 = random_state(op, 2, 2, 8, 4, seed=18)
    gen = torch.Generator().manual_seed(19)
    do = torch.randn(1, 70, 2, 4, generator=gen, dtype=torch.float64)
    dst = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in h0]

    def run(backend, dtype):
        leaves = [x.to(device=dev, dtype=dtype).requires_grad_() for x in (q, k, v, g, *h0)]
        o, fin = POS[op](*leaves[:4], decay=decay, initial_state=type(h0)(*leaves[4:]), output_final_state=True,
                         cu_seqlens=cu, backend=backend)
        loss = (o * do.to(o)).sum() + sum((f * d.to(f)).sum() for f, d in zip(fin, dst, strict=True))
        return [o, *fin], torch.autograd.grad(loss, leaves)

    (out_t, grad_t), (out_r, grad_r) = run("triton", torch.float32), run("naive", torch.float64)
    assert out_t[0].dtype == torch.float32 and all(f.dtype == torch.float32 for f in out_t[1:])
    for a, b in zip(out_t + list(grad_t), out_r + list(grad_r), strict=True):
        assert error_ratio(a, b) < 1e-4


@pytest.mark.skipif(not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("op,decay,normalize", [*((op, decay, False) for op, decay in CASES), ("hla2", "d1", True)])
def test_compose16_runs_passes_in_the_input_dtype(monkeypatch, op, decay, normalize):
    """compose16: bf16 inputs of hla2 and hla3 on the "triton" backend run linear_attn's passes in their own dtype,
    decays and states in fp32. Here in fp16 (the interpreter cannot multiply bf16; fp16 is admitted for the test
    only, its range being too small for HLA's growing values) and for every op (ahla admitted for the test):
    output, final states and every gradient within 16-bit rounding of the float64 definition on the same values
    (varlen, initial state; normalized with non-negative features and a strong decay). An op outside compose16
    (ahla's default) runs the same call's passes in fp32, more exactly."""
    from hilo_kernels.hla import compose

    assert compose.COMPOSE16_DTYPES == (torch.bfloat16,)
    monkeypatch.setattr(compose, "COMPOSE16_DTYPES", (torch.bfloat16, torch.float16))

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cu = torch.tensor([0, 3, 70], device=dev)
    q, k, v, g = make(1, 70, 2, 16, 8, "strong" if normalize else "weak", seed=23)
    if normalize:  # the layer's feature map for normalized HLA: non-negative q and k (docs/kernels.md)
        q, k = (torch.nn.functional.elu(x) + 1 for x in (q, k))
    q, k, v = (x.half().double() for x in (q, k, v))  # values exact in fp16
    h0 = random_state(op, 2, 2, 16, 8 + normalize, seed=24)  # normalize: one value column more, the denominator
    gen = torch.Generator().manual_seed(25)
    do = torch.randn(1, 70, 2, 8, generator=gen, dtype=torch.float64)
    dst = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in h0]
    seen = []

    def recording_linear_attn(q, k, v, g, **kw):
        seen.append((q.dtype, k.dtype, v.dtype, None if g is None else g.dtype))
        return linear_attn(q, k, v, g=g, **kw)

    monkeypatch.setattr(compose, "linear_attn", recording_linear_attn)

    def run(backend, dtype):
        leaves = [x.to(device=dev, dtype=dtype if i < 3 else torch.promote_types(dtype, torch.float32))
                  .requires_grad_() for i, x in enumerate((q, k, v, g, *h0))]
        o, fin = POS[op](*leaves[:4], decay=decay, initial_state=type(h0)(*leaves[4:]), output_final_state=True,
                         cu_seqlens=cu, backend=backend, normalize=normalize)
        loss = (o.double() * do.to(dev)).sum() + sum((f.double() * d.to(dev)).sum() for f, d in zip(fin, dst))
        return [o, *fin], torch.autograd.grad(loss, leaves)

    out_r, grad_r = run("naive", torch.float64)
    errors = {}
    for flag in (True, False):
        monkeypatch.setattr(compose, "COMPOSE16_OPS", (op,) if flag else ())
        seen.clear()
        out, grads = run("triton", torch.float16)
        assert seen and all(d[:3] == ((torch.float16,) * 3 if flag else (torch.float32,) * 3) for d in seen), seen
        assert all(d[3] == torch.float32 for d in seen)
        assert out[0].dtype == torch.float16 and all(f.dtype == torch.float32 for f in out[1:])
        errors[flag] = [error_ratio(a, b) for a, b in zip(out + list(grads), out_r + list(grad_r), strict=True)]
    names = ["o", *(f"final {f}" for f in h0._fields), "dq", "dk", "dv", "dg", *(f"d{f}0" for f in h0._fields)]
    for name, err in zip(names, errors[True], strict=True):  # fp16's unit roundoff is 4.9e-4; the gate's sum twice
        assert err < (3e-3 if name == "dg" else 1.5e-3), (name, err)
    assert max(errors[False]) < 1e-3 and max(errors[False]) < max(errors[True]), errors


def test_default_backend_takes_compose16_for_bf16_hla2_and_hla3():
    """backend=None on CUDA: bf16 hla2 and hla3 take the bf16 composition (within the bf16 check on the H200 and
    faster than the fused kernels), ahla and other dtypes keep the fused kernels (hla3: fp32 passes); off CUDA the
    choice is resolve_backend's."""
    from hilo_kernels.hla import compose, default_backend

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert [default_backend(op, bf16, True) for op in ("hla2", "ahla", "hla3")] == ["triton", "fused", "triton"]
    assert [default_backend(op, fp16, True) for op in ("hla2", "ahla", "hla3")] == ["fused", "fused", "triton"]
    assert default_backend("hla2", fp32, True) == "fused"
    assert default_backend("hla2", torch.float64, True) is None and default_backend("hla2", bf16, False) is None
    assert [compose.pass_dtype(op, bf16, "triton") for op in ("hla2", "ahla", "hla3")] == [bf16, fp32, bf16]
    assert compose.pass_dtype("hla2", bf16, "torch") == fp32 and compose.pass_dtype("hla3", fp16, "triton") == fp32


def test_low_precision_inputs():
    """bf16 inputs: o in bf16, states fp32, close to the float64 definition (the passes run in fp32)."""
    q, k, v, g = make(1, 24, 2, 8, 4, "weak", seed=20)
    for op, decay in CASES:
        o, st = POS[op](q.bfloat16(), k.bfloat16(), v.bfloat16(), g.float(), decay=decay, output_final_state=True)
        assert o.dtype == torch.bfloat16 and all(x.dtype == torch.float32 for x in st)
        ref = hla_masked(op, q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double(), g, decay=decay)
        assert error_ratio(o, ref) < 1e-2


def test_errors():
    q, k, v, _ = make(1, 5, 1, 4, 3, None)
    with pytest.raises(ValueError, match="only decay='d1'"):
        ahla(q, k, v, decay="d2")
    with pytest.raises(ValueError, match="only decay='d1'"):
        hla3(q, k, v, decay="d2")
    with pytest.raises(ValueError, match="decay must be one of"):
        hla2(q, k, v, decay="d3")
    with pytest.raises(TypeError, match="HLA2State"):
        hla2(q, k, v, initial_state=torch.zeros(1, 1, 4, 3))
    with pytest.raises(ValueError, match="extra value column|adds one value column"):
        hla2(q, k, v, normalize=True, initial_state=random_state("hla2", 1, 1, 4, 3, seed=0))
    with pytest.raises(ValueError, match="eps must be > 0"):
        hla2(q, k, v, normalize=True, eps=0.0)
    with pytest.raises(ValueError, match="hla3: v must be"):
        hla3(q, k, v[:, :4])



def test_fused_precision():
    """The fused kernels' dot precision: fp32 inputs multiply in full fp32 ("ieee"), 16-bit inputs take tf32 products
    of fp32 tiles."""
    from hilo_kernels.hla import triton_fused

    assert triton_fused._precision(torch.zeros(1)) == "ieee"
    assert triton_fused._precision(torch.zeros(1, dtype=torch.bfloat16)) == "tf32"
    assert triton_fused._precision(torch.zeros(1, dtype=torch.float16)) == "tf32"


# The paper's wrong formulas (docs/kernels.md: errors hilo must not reproduce), kept so nobody "fixes" ours towards them.

def paper_third_order_streaming(q, k, v):
    """The paper's third-order streaming identity as the paper states it: it starts from the prefix product
    S^K S^Q P^KV (all triples i, j, l <= t) and removes, as each token t arrives, the triples where t is the key
    index i with j, l < t (G^(1) += k_t k_t^T S^Q_{t-1} P_{t-1}) or the value index l with i, j < t
    (G^(2) += S^K_{t-1} S^Q_{t-1} k_t v_t^T), but never the triples i = l = t > j: those whose largest index occurs
    twice stay in. WRONG: it is not the masked W W^T W operator."""
    b, t, h, dk = q.shape
    sk = torch.zeros(b, h, dk, dk, dtype=q.dtype)
    sq = torch.zeros_like(sk)
    p = torch.zeros(b, h, dk, v.shape[-1], dtype=q.dtype)
    g1, g2 = torch.zeros_like(p), torch.zeros_like(p)
    outs = []
    for i in range(t):
        qt, kt, vt = q[:, i], k[:, i], v[:, i]
        kk = kt[..., :, None] * kt[..., None, :]
        g1 = g1 + kk @ sq @ p
        g2 = g2 + sk @ sq @ (kt[..., :, None] * vt[..., None, :])
        sk, sq, p = sk + kk, sq + qt[..., :, None] * qt[..., None, :], p + kt[..., :, None] * vt[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", qt, sk @ sq @ p - g1 - g2))
    return torch.stack(outs, 1)


def test_paper_third_order_identity_is_not_hla3():
    q, k, v, _ = make(2, 21, 2, 4, 3, None, seed=21)
    ours, _ = hla3(q, k, v)
    paper = paper_third_order_streaming(q, k, v)
    assert error_ratio(paper, ours) > 0.1
    # ... and the difference is exactly the triples j < i = l <= t
    a = torch.einsum("bthk,bshk->bhts", q, k)  # a[t, s] = q_t . k_s
    t = q.shape[1]
    r = torch.arange(t)
    mask = ((r[None, :, None] < r[None, None, :]) & (r[None, None, :] <= r[:, None, None])).to(q.dtype)  # [t, j, i]
    extra = torch.einsum("tji,bhti,bhji,bhji,bhiv->bthv", mask, a, a, a, v.transpose(1, 2))
    assert error_ratio(paper - ours, extra) < F64


def serial_paper_state(q, k, v, g, rule):
    """The paper's streaming state (S^K, C^QV, G) token by token, o_t = q_t^T (S C - G), with a = exp(g_t):
    "d2"    S = a S + k k^T,  C = a C + q v^T,  G = a^2 G + a k (k^T C_prev)   (the consistent rule)
    "paper" S = a S + k k^T,  C = a C + q v^T,  G = a G + k (k^T C_prev)       (the paper's decayed rule: WRONG)"""
    b, t, h, dk = q.shape
    s = torch.zeros(b, h, dk, dk, dtype=q.dtype)
    c = torch.zeros(b, h, dk, v.shape[-1], dtype=q.dtype)
    big_g = torch.zeros_like(c)
    outs = []
    for i in range(t):
        a = g[:, i].exp()[..., None, None]
        qt, kt, vt = q[:, i], k[:, i], v[:, i]
        kk = kt[..., :, None] * kt[..., None, :]
        big_g = (a * a * big_g + a * kk @ c) if rule == "d2" else (a * big_g + kk @ c)
        s, c = a * s + kk, a * c + qt[..., :, None] * vt[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", qt, s @ c - big_g))
    return torch.stack(outs, 1)


def test_paper_decayed_serial_rule_matches_no_masked_operator():
    q, k, v, _ = make(2, 25, 2, 4, 3, None, seed=22)
    g = torch.full(q.shape[:3], -0.3, dtype=torch.float64)  # the paper's constant gamma
    d1, _ = hla2(q, k, v, g=g, decay="d1")
    d2, _ = hla2(q, k, v, g=g, decay="d2")
    assert error_ratio(serial_paper_state(q, k, v, g, "d2"), d2) < F64
    undecayed, _ = hla2(q, k, v)
    assert error_ratio(serial_paper_state(q, k, v, torch.zeros_like(g), "paper"), undecayed) < F64
    paper = serial_paper_state(q, k, v, g, "paper")
    assert error_ratio(paper, d1) > 0.05 and error_ratio(paper, d2) > 0.05


def paper_decayed_combine(a, b):
    """The paper's decayed scan operator: G_AB = rho_B G_A + G_B + S_B (rho_B C_A). WRONG: not associative."""
    rm = b.rho[..., None, None]
    return Summary(rm * a.S + b.S, rm * a.C + b.C, b.rho[..., None] * a.m + b.m, rm * a.G + b.G + b.S @ (rm * a.C),
                   b.rho[..., None] * a.h + b.h + (b.S @ (b.rho[..., None] * a.m)[..., None])[..., 0],
                   a.rho * b.rho)


def test_decayed_scan_operator_associativity():
    gen = torch.Generator().manual_seed(23)

    def rand_summary():
        shapes = ((2, 4, 4), (2, 4, 3), (2, 4), (2, 4, 3), (2, 4))
        return Summary(*(torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes),
                       torch.rand(2, generator=gen, dtype=torch.float64) * 0.9 + 0.05)

    x, y, z = rand_summary(), rand_summary(), rand_summary()
    for left, right in zip(combine(combine(x, y), z), combine(x, combine(y, z)), strict=True):
        assert error_ratio(left, right) < F64
    left = paper_decayed_combine(paper_decayed_combine(x, y), z)
    right = paper_decayed_combine(x, paper_decayed_combine(y, z))
    assert error_ratio(left.G, right.G) > 0.01


@pytest.mark.parametrize("gate", [None, "strong", "weak"])
def test_ahla_scan_matches_masked_and_composition(gate):
    """The AHLA associative scan (R not decayed) == masked ahla == hilo_kernels.ahla, chunks down to single tokens."""
    q, k, v, g = make(2, 23, 2, 4, 3, gate, seed=25)
    ref = hla_masked("ahla", q, k, v, g, scale=0.8)
    assert error_ratio(ahla(q, k, v, g=g, scale=0.8, backend="torch")[0], ref) < F64
    for chunk in (1, 5, 8, 32):
        assert error_ratio(ahla_scan(q, k, v, g, scale=0.8, chunk=chunk), ref) < F64, chunk
    x = ahla_token_summaries(q[:, :3], k[:, :3], v[:, :3], None if g is None else g[:, :3])
    x, y, z = (AHLASummary(*(None if f is None else f[:, i] for f in x)) for i in range(3))
    for left, right in zip(ahla_combine(ahla_combine(x, y), z), ahla_combine(x, ahla_combine(y, z)), strict=True):
        assert left is right is None or error_ratio(left, right) < F64


def paper_ahla_combine(a, b):
    """The paper's decayed AHLA scan operator decays R^KQ across segments, R_AB = rho_B R_A + R_B
    (else as ahla_combine). WRONG: the cross term rho_B R_B P_A needs the undecayed R_B = sum_{i in B} k_i q_i^T;
    a serial fold (single-token right operands) hides it, a scan over multi-token segments does not."""
    return ahla_combine(a, b)._replace(R=b.rho[..., None, None] * a.R + b.R)


def test_paper_ahla_decayed_scan_is_not_ahla():
    q, k, v, g = make(2, 23, 2, 4, 3, "strong", seed=26)
    g = 0.25 * g  # decay over a 13-token segment still leaves its cross term visible
    ref = hla_masked("ahla", q, k, v, g)
    paper = ahla_scan(q, k, v, g, chunk=8, op=paper_ahla_combine)
    assert error_ratio(paper, ref) > 0.05
    zero = torch.zeros_like(g)  # without decay the two operators coincide: the error is R's decay only
    assert error_ratio(ahla_scan(q, k, v, zero, op=paper_ahla_combine), hla_masked("ahla", q, k, v)) < F64

    def fold(op, lo, hi):  # serial left fold over tokens lo..hi-1
        toks = ahla_token_summaries(q, k, v, g)
        acc = AHLASummary(*(None if f is None else f[:, lo] for f in toks))
        for i in range(lo + 1, hi):
            acc = op(acc, AHLASummary(*(None if f is None else f[:, i] for f in toks)))
        return acc

    ours = ahla_combine(fold(ahla_combine, 0, 10), fold(ahla_combine, 10, 23))
    wrong = paper_ahla_combine(fold(paper_ahla_combine, 0, 10), fold(paper_ahla_combine, 10, 23))
    # ... and its E differs from ours by exactly rho_B (R_B decayed - R_B) P_A, R_B decayed = sum (b_end/b_i) k_i q_i^T
    cum = g.cumsum(1)
    w_dec = (cum[:, -1:] - cum[:, 10:]).exp() - 1.0  # [B, 13, H]
    r_diff = torch.einsum("bih,bihk,bihl->bhkl", w_dec, k[:, 10:], q[:, 10:])
    rho_b = (cum[:, -1] - cum[:, 9]).exp()[..., None, None]
    term = rho_b * r_diff @ fold(ahla_combine, 0, 10).P
    assert error_ratio(wrong.E - ours.E, term) < F64 and error_ratio(wrong.E, ours.E) > 0.05


def paper_fig1_chunked(q, k, v, chunk):
    """The paper's Fig. 1 chunk formula (undecayed hla2): O_c = Q_c F_prev + ((W_c W_c^T) * L) V_c,
    W_c = L * Q_c K_c^T, with the carried S, F updated exactly. WRONG: it omits the cross term
    ((Q_c S_prev Q_c^T) * L) V_c, the triples whose key lies before the chunk and whose value lies in it."""
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
    s = qh.new_zeros(*qh.shape[:2], qh.shape[-1], qh.shape[-1])
    f = qh.new_zeros(*qh.shape[:2], qh.shape[-1], vh.shape[-1])
    outs = []
    for c0 in range(0, q.shape[1], chunk):
        qc, kc, vc = (x[..., c0:c0 + chunk, :] for x in (qh, kh, vh))
        w = (qc @ kc.transpose(-1, -2)).tril()
        outs.append(qc @ f + (w @ w.transpose(-1, -2)).tril() @ vc)
        f = f + (qc @ s + w @ kc).transpose(-1, -2) @ vc  # rows S_j q_j, j in the chunk
        s = s + kc.transpose(-1, -2) @ kc
    return torch.cat(outs, -2).transpose(1, 2)


def paper_fig2_exclusive_readout(q, k, v):
    """The paper's Fig. 2 read-out: o_t = q_t^T (S C - G) of the exclusive Blelloch prefix R_{<t}
    (the summary of tokens < t) instead of the inclusive R_{<=t}. WRONG: it drops every term whose value index is
    t itself, (sum_{i <= t} (q_t.k_i)^2) v_t."""
    tokens = token_summaries(q, k, v)
    prefix = blelloch_exclusive_scan([Summary(*(None if f is None else f[:, i] for f in tokens))
                                      for i in range(q.shape[1])])
    return torch.stack([torch.einsum("bhk,bhkv->bhv", q[:, i], p.S @ p.C - p.G) for i, p in enumerate(prefix)], 1)


def test_paper_chunk_formulas_are_not_hla2():
    q, k, v, _ = make(2, 21, 2, 4, 3, None, seed=27)
    ref = hla_masked("hla2", q, k, v)
    assert error_ratio(hla2_chunked(q, k, v, chunk=8)[0], ref) < F64
    assert error_ratio(hla2_scan(q, k, v, chunk=8)[0], ref) < F64  # inclusive read-out
    a = torch.einsum("bthk,bshk->bhts", q, k)  # a[t, s] = q_t . k_s
    vh = v.transpose(1, 2)
    fig1 = paper_fig1_chunked(q, k, v, chunk=8)
    assert error_ratio(fig1, ref) > 0.1
    r = torch.arange(q.shape[1])
    start = r // 8 * 8  # first token of t's chunk
    mask = ((r[None, None, :] < start[:, None, None]) & (start[:, None, None] <= r[None, :, None])
            & (r[None, :, None] <= r[:, None, None])).to(q.dtype)  # [t, j, i]: i < chunk start <= j <= t
    cross = torch.einsum("tji,bhti,bhji,bhjv->bthv", mask, a, a, vh)
    assert error_ratio(ref - fig1, cross) < F64
    fig2 = paper_fig2_exclusive_readout(q, k, v)
    assert error_ratio(fig2, ref) > 0.1
    own = torch.einsum("bhts,bhtv->bthv", (a * a).tril(), vh)  # j = t: (sum_{i <= t} (q_t.k_i)^2) v_t
    assert error_ratio(ref - fig2, own) < F64


# The fused chunked kernels (backend "fused", hla2 and ahla): fp32 (under the interpreter without CUDA) against the
# float64 oracles on the CPU.
FUSED_DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _fused_vs_references(q, k, v, g, h0, decay, normalize=False, scale=1.0, cu=None, seed=30, op="hla2"):
    """Outputs, both final states and every gradient (q, k, v, g, both initial states) of "fused" in fp32 against
    the float64 token recurrence ("naive") and composition ("torch"): error ratios <= 1e-4 (<= 1e-9 between the
    two references)."""
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(v.shape, generator=gen, dtype=torch.float64)
    dst = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in h0]

    def run(backend, dtype):
        dev = FUSED_DEV if backend == "fused" else "cpu"
        leaves = [None if x is None else x.to(device=dev, dtype=dtype).requires_grad_() for x in (q, k, v, g, *h0)]
        o, fin = POS[op](*leaves[:4], decay=decay, normalize=normalize, scale=scale,
                         initial_state=type(h0)(*leaves[4:]), output_final_state=True,
                         cu_seqlens=None if cu is None else cu.to(dev), backend=backend)
        loss = (o * do.to(o)).sum() + sum((f * d.to(f)).sum() for f, d in zip(fin, dst, strict=True))
        inputs = [x for x in leaves if x is not None]
        return [x.cpu() for x in (o, *fin)], [x.cpu() for x in torch.autograd.grad(loss, inputs)]

    out_f, grad_f = run("fused", torch.float32)
    assert out_f[0].dtype == torch.float32 and all(x.dtype == torch.float32 for x in out_f[1:])
    out_n, grad_n = run("naive", torch.float64)
    out_c, grad_c = run("torch", torch.float64)
    names = ["o", *h0._fields] + [n for n, x in zip(["dq", "dk", "dv", "dg"], (q, k, v, g), strict=True)
                                   if x is not None] + [f"d{f}0" for f in h0._fields]
    for name, a, b, c in zip(names, out_f + grad_f, out_n + grad_n, out_c + grad_c, strict=True):
        assert error_ratio(c, b) < 1e-9, name
        assert error_ratio(a, b) < 1e-4, name


@pytest.mark.skipif(not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("decay", ["d1", "d2"])
@pytest.mark.parametrize("gate", ["strong", "weak", "zero", None])
def test_fused_hla2_matches_float64(decay, gate):
    """T = 75 crosses the 64-token chunks; B = 2 rows, an initial state, scale != 1, zeroed and absent gates."""
    q, k, v, g = make(2, 75, 2, 20, 12, "weak" if gate == "zero" else gate, seed=31)
    g = torch.zeros_like(g) if gate == "zero" else g
    h0 = random_state("hla2", 2, 2, 20, 12, seed=32)
    _fused_vs_references(q, k, v, g, h0, decay, scale=0.8)


@pytest.mark.skipif(not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("decay", ["d1", "d2"])
def test_fused_hla2_varlen_odd_dims(decay):
    """Documents of 1, 15 and 130 tokens packed in one row (the last spans three chunks), K = 60, V = 36."""
    cu = torch.tensor([0, 1, 16, 146])
    q, k, v, g = make(1, 146, 2, 60, 36, "strong", seed=33)
    q, k = 0.5 * q, 0.5 * k
    h0 = random_state("hla2", 3, 2, 60, 36, seed=34)
    _fused_vs_references(q, k, v, g, h0, decay, cu=cu)


@pytest.mark.skipif(not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
def test_fused_hla2_normalize():
    """normalize=True: the denominator rides as a V + 1-th value column of F (non-negative feature maps)."""
    q, k, v, g = make(1, 70, 2, 12, 7, "weak", seed=35)
    q, k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    h0 = random_state("hla2", 1, 2, 12, 8, seed=36)
    h0 = HLA2State(h0.S.abs(), h0.F.abs())
    _fused_vs_references(q, k, v, g, h0, "d1", normalize=True)


def test_fused_launch_settings():
    """The fused kernels' launches per kernel family: 4 warps, 2 stages, no register cap by default; the launch
    settings override them inside launch_settings and not after."""
    from hilo_kernels.common import launch_settings
    from hilo_kernels.hla import triton_fused

    for family in ("scan", "out", "dvalues", "dqk"):
        assert triton_fused._launch_kwargs(family) == {"num_warps": 4, "num_stages": 2}
    with launch_settings(hla={"out_warps": 8, "scan_stages": 3, "dqk_maxnreg": 128}):
        assert triton_fused._launch_kwargs("out") == {"num_warps": 8, "num_stages": 2}
        assert triton_fused._launch_kwargs("scan") == {"num_warps": 4, "num_stages": 3}
        assert triton_fused._launch_kwargs("dqk") == {"num_warps": 4, "num_stages": 2, "maxnreg": 128}
    assert triton_fused._launch_kwargs("dqk") == {"num_warps": 4, "num_stages": 2}


def _record_launches(monkeypatch, names, key) -> dict:
    """Wrap the fused kernels `names` of hilo_kernels.hla.triton_fused so every launch still runs and adds key(grid,
    keyword arguments) to the returned {kernel name: set} (filled as the kernels launch)."""
    from hilo_kernels.hla import triton_fused

    seen = {}

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.setdefault(self.kernel.fn.__name__, set()).add(key(grid, kwargs))
                return self.kernel[grid](*args, **kwargs)
            return launch

    for name in names:
        monkeypatch.setattr(triton_fused, name, Recorder(getattr(triton_fused, name)))
    return seen


@pytest.mark.skipif(not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("tile", [16, 128])
def test_fused_launch_tiles(monkeypatch, tile):
    """Every tile setting at 16 (several K- and V-blocks per loop at K = 60, V = 36, masked) and at 128 (one wide
    masked block), with other warps, stages and a register cap: the kernels launch with those tiles (recorded) and
    hla2 still matches the float64 references, varlen with an initial state."""
    from hilo_kernels.common import launch_settings

    options = {"scan_by": tile, "out_bk": tile, "out_by": tile, "dvalues_bk": tile, "dvalues_bv": tile,
               "dqk_bk": tile, "dqk_bv": tile, "out_warps": 4, "dqk_stages": 3, "dvalues_maxnreg": 128}
    seen = _record_launches(monkeypatch, ("_state_scan", "_chunk_out", "_pass_dvalues", "_pass_dqk"),
                            lambda grid, kw: tuple(kw[n] for n in ("BX", "BY", "BK", "BV") if n in kw))
    cu = torch.tensor([0, 1, 16, 146])
    q, k, v, g = make(1, 146, 2, 60, 36, "strong", seed=33)
    h0 = random_state("hla2", 3, 2, 60, 36, seed=34)
    with launch_settings(hla=options):
        _fused_vs_references(0.5 * q, 0.5 * k, v, g, h0, "d1", cu=cu)
    wide = 64 if tile == 128 else tile  # 128 exceeds K = 60 and V = 36, whose next powers of two are 64
    assert seen["_state_scan"] == {(64, wide)}  # the scans' K-rows stay 64
    assert seen["_chunk_out"] == {(wide, wide)}  # BY, BK (keyword order of the recorder: BY before BK)
    assert seen["_pass_dvalues"] == {(wide, wide)} and seen["_pass_dqk"] == {(wide, wide)}


@pytest.mark.skipif(not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dk,cols", [(60, 64), (160, 32)])
def test_fused_output_columns_by_head_size(monkeypatch, dk, cols):
    """The chunk kernels' output columns by default: 64 up to K = 128, 32 above (hla_cols, timed at K = 256),
    recorded at V = 72 (whose next power of two is 128) while ahla still matches the float64 references; a setting
    given by name wins at any K."""
    from hilo_kernels.common import launch_settings
    from hilo_kernels.common.launch import hla_cols

    seen = _record_launches(monkeypatch, ("_chunk_out", "_pass_dvalues"),
                            lambda grid, kw: kw["BY"] if "BY" in kw else kw["BV"])
    q, k, v, g = make(1, 70, 1, dk, 72, "strong", seed=41)
    h0 = random_state("ahla", 1, 1, dk, 72, seed=42)
    _fused_vs_references(0.5 * q, 0.5 * k, v, g, h0, "d1", op="ahla")
    assert seen["_chunk_out"] == {cols} and seen["_pass_dvalues"] == {cols}
    assert [hla_cols(d) for d in (128, 129)] == [(64, 64), (32, 32)]
    with launch_settings(hla={"out_by": 16}):
        assert hla_cols(dk) == (16, cols)
    assert hla_cols(dk) == (cols, cols)


@pytest.mark.skipif(not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("op,decay", [("hla2", "d1"), ("hla2", "d2"), ("ahla", "d1")])
def test_fused_without_states(op, decay):
    """No initial state and no final state (the kernels' other branches, through the custom op pair
    hilo::hla_fused): o and every grad against the float64 masked matrices through autograd, on two rows of 130
    tokens."""
    q, k, v, g = make(2, 130, 2, 16, 8, "weak", seed=37)
    gen = torch.Generator().manual_seed(38)
    do = torch.randn(v.shape, generator=gen, dtype=torch.float64)

    def grads(fn, dtype, dev):
        leaves = [x.to(device=dev, dtype=dtype).requires_grad_() for x in (q, k, v, g)]
        o = fn(*leaves)
        return [x.cpu() for x in (o, *torch.autograd.grad((o * do.to(o)).sum(), leaves))]

    got = grads(lambda *x: POS[op](*x, decay=decay, backend="fused")[0], torch.float32, FUSED_DEV)
    ref = grads(lambda *x: hla_masked(op, *x, decay=decay), torch.float64, "cpu")
    for name, a, b in zip(["o", "dq", "dk", "dv", "dg"], got, ref, strict=True):
        assert error_ratio(a, b) < 1e-4, name


@pytest.mark.skipif(not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("op,decay,normalize,gated", [("hla2", "d1", False, True), ("hla2", "d2", True, True),
                                                      ("ahla", "d1", False, False)])
def test_fused_custom_op_compiles_into_one_graph(op, decay, normalize, gated):
    """Fixed-length calls of the fused backend without states are the torch.library op "hilo::hla_fused" (its
    forward returns the inner output and both passes' chunk states for the backward, so nothing is recomputed):
    torch.compile traces them as one node (fullgraph), with eager's values and gradients, and the fakes give the
    real outputs' shapes, dtypes and strides (T = 70: a partial second chunk)."""
    from hilo_kernels.common.compile import compile_safe_operators
    from tests.kernels.compile_checks import assert_one_graph_with_eager_values

    traced = compile_safe_operators()[id(OPS[op])]  # what a compiled model holds: traced here, not opaque
    q, k, v, g = (x.float() for x in make(2, 70, 2, 12, 6, "weak", seed=47))
    if normalize:
        q, k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    leaves = [x.to(FUSED_DEV).requires_grad_() for x in ((q, k, v, g) if gated else (q, k, v))]

    def f(q, k, v, g=None):
        o, _ = traced(q * 1.5, k, v, g=g, decay=decay, normalize=normalize, backend="fused")
        return o.float().square().sum()

    assert_one_graph_with_eager_values(f, leaves, "hla_fused", rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("op", ["hla2", "ahla", "hla3"])
def test_composition_compiles_into_one_graph(monkeypatch, op):
    """The "triton" composition (hla3's only path; bf16 hla2's default on CUDA) as separate passes (the path of calls
    the one op does not cover; test_hla_one_op_compiles_into_one_graph has the one op) as a compiled model holds it: a fixed-length
    call without states is traced, its linear_attn passes custom ops in one graph (no break at the operator), with
    eager's values and gradients; with packed documents it stays opaque."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from hilo_kernels.common.compile import compile_safe_operators
    from hilo_kernels.hla import compose
    from tests.kernels.compile_checks import assert_one_graph_with_eager_values

    monkeypatch.setattr(compose, "_one_op", lambda *args: False)  # the separate passes

    traced = compile_safe_operators()[id(OPS[op])]
    q, k, v, g = (x.float() for x in make(2, 70, 2, 12, 6, "weak", seed=48))
    leaves = [x.to(FUSED_DEV).requires_grad_() for x in (q, k, v, g)]

    def f(q, k, v, g):
        o, _ = traced(q, k, v, g=g, backend="triton")
        return o.float().square().sum()

    assert_one_graph_with_eager_values(f, leaves, "linear_attn", rtol=1e-4, atol=1e-5)
    cu = torch.tensor([0, 30, 140], device=FUSED_DEV)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")

    def packed(q, k, v, g):
        q, k, v, g = (y.reshape(1, 140, *y.shape[2:]) for y in (q, k, v, g))
        return traced(q, k, v, g=g, cu_seqlens=cu, backend="triton")[0].sum()

    got = torch.compile(packed, backend=counter)(*leaves)
    assert not any("hilo." in gm.code for gm in counter.graphs)  # the operator ran outside every graph
    assert torch.allclose(got, packed(*leaves), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("op", ["hla2", "ahla"])
def test_fused_initial_state_without_final_state(op):
    """initial_state given, output_final_state=False: the backward starts both reverse scans from zero."""
    q, k, v, g = make(1, 80, 2, 12, 6, "weak", seed=45)
    h0 = random_state(op, 2, 2, 12, 6, seed=46)
    cu = torch.tensor([0, 30, 80])

    def run(dev, dtype):
        leaves = [x.to(device=dev, dtype=dtype).requires_grad_() for x in (q, k, v, g, *h0)]
        o, fin = POS[op](*leaves[:4], initial_state=type(h0)(*leaves[4:]), cu_seqlens=cu.to(dev),
                         backend="fused" if dev == FUSED_DEV and dtype == torch.float32 else "naive")
        assert fin is None
        return [x.cpu() for x in (o, *torch.autograd.grad(o.square().sum(), leaves))]

    for name, a, b in zip(["o", "dq", "dk", "dv", "dg", "d0", "d1"], run(FUSED_DEV, torch.float32),
                          run("cpu", torch.float64), strict=True):
        assert error_ratio(a, b) < 1e-4, name


@pytest.mark.skipif(not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
def test_fused_hla2_wide_keys():
    """K = 130 > 128 (three 64-wide K blocks, the last partial), V = 20, with states."""
    q, k, v, g = make(1, 20, 1, 130, 20, "weak", seed=43)
    q, k = 0.3 * q, 0.3 * k
    _fused_vs_references(q, k, v, g, random_state("hla2", 1, 1, 130, 20, seed=44), "d1")


@pytest.mark.skipif(not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
def test_fused_hla2_low_precision_inputs():
    """bf16 / fp16 inputs: o and grads in the inputs' dtype, states fp32, close to the float64 definition."""
    q, k, v, g = make(1, 70, 2, 16, 8, "weak", seed=39)
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float16, 2e-3)):
        leaves = [x.to(device=FUSED_DEV, dtype=dtype).requires_grad_() for x in (q, k, v)]
        o, st = hla2_pos(*leaves, g.float().to(FUSED_DEV), backend="fused", output_final_state=True)
        assert o.dtype == dtype and all(x.dtype == torch.float32 for x in st)
        dq, = torch.autograd.grad(o.float().square().sum(), leaves[:1])
        assert dq.dtype == dtype
        o, dq = o.cpu(), dq.cpu()
        exact = [x.detach().cpu().double().requires_grad_() for x in leaves]
        ref = hla_masked("hla2", *exact, g)
        ref_dq, = torch.autograd.grad(ref.square().sum(), exact[:1])
        assert error_ratio(o, ref) < tol and error_ratio(dq, ref_dq) < 2 * tol, dtype


@pytest.mark.skipif(not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("gate", ["strong", None])
def test_fused_ahla_matches_float64(gate):
    """ahla through the same kernels (V~ = LA(Q, K, V; g), O = LA(Q, K, V~; g)): varlen 1, 15, 59 tokens with
    initial states, K = 20, V = 12, then normalize=True on one row of 75."""
    q, k, v, g = make(1, 75, 2, 20, 12, gate, seed=40)
    h0 = random_state("ahla", 3, 2, 20, 12, seed=41)
    _fused_vs_references(q, k, v, g, h0, "d1", scale=0.8, cu=torch.tensor([0, 1, 16, 75]), op="ahla")
    q, k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    h0 = random_state("ahla", 1, 2, 20, 13, seed=42)
    _fused_vs_references(q, k, v, g, AHLAState(h0.P.abs(), h0.E.abs()), "d1", normalize=True, op="ahla")


@pytest.mark.skipif(not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
def test_fused_backend_errors():
    q, k, v, _ = (None if x is None else x.to(FUSED_DEV) for x in make(1, 5, 1, 4, 3, None))
    with pytest.raises(ValueError, match="hla2 and ahla only"):
        hla3(q.float(), k.float(), v.float(), backend="fused")
    with pytest.raises(TypeError, match="float32"):
        hla2(q, k, v, backend="fused")


def _spy_accumulating_backward(monkeypatch):
    """Records (dq_acc given, self_values) of every linear_attn chunk_bwd call hilo_kernels.hla.compose_op makes."""
    from hilo_kernels.hla import compose_op

    calls = []
    real = compose_op.chunk_bwd

    def spy(*args, **kwargs):
        calls.append((kwargs.get("dq_acc") is not None, bool(kwargs.get("self_values"))))
        return real(*args, **kwargs)

    monkeypatch.setattr(compose_op, "chunk_bwd", spy)
    return calls


# the accumulating chunk_bwd calls (dq_acc given, self_values) each one op makes, outer pass first
ONE_OP_CALLS = {"hla2": [(False, False), (True, True)], "hla3": [(False, False), (True, False), (True, True)]}


@pytest.mark.skipif(not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("op,decay,gate,states,dv", [
    ("hla2", "d1", "weak", False, 32), ("hla2", "d2", "strong", True, 48), ("hla2", "d1", None, True, 16),
    ("hla2", "d2", None, False, 32), ("hla3", "d1", "weak", True, 32), ("hla3", "d1", "strong", False, 48),
    ("hla3", "d1", None, True, 16)])
def test_hla_one_op_keeps_the_values(monkeypatch, op, decay, gate, states, dv):
    """hla2's two and hla3's three passes as one op (where it applies), whose earlier
    passes' backward kernels add the later passes' dq into their own, the first storing the keys' and values'
    gradients summed: the same output, final states and gradients (initial states' included) as the separate
    linear_attn passes (fp32, T = 150: a partial last chunk, scale 0.7; V = K, wider and narrower, as hla_mamba2's
    V = 64 for K = 128), and the op is the path taken."""
    from hilo_kernels.hla import compose

    fn = {"hla2": hla2_pos, "hla3": hla3_pos}[op]
    q, k, v, g = make(2, 150, 2, 32, dv, gate, seed=51, dtype=torch.float32)
    h0 = random_state(op, 2, 2, 32, dv, seed=55, dtype=torch.float32) if states else None
    leaves = [x.to(FUSED_DEV).requires_grad_() for x in (q, k, v)]
    gl = None if g is None else g.to(FUSED_DEV).requires_grad_()
    h0l = None if h0 is None else type(h0)(*(x.to(FUSED_DEV).requires_grad_() for x in h0))
    wrt = leaves + ([gl] if gl is not None else []) + (list(h0l) if h0l is not None else [])
    gen = torch.Generator().manual_seed(52)
    do = torch.randn(v.shape, generator=gen).to(FUSED_DEV)
    dfin = [torch.randn(x.shape, generator=gen).to(FUSED_DEV) for x in h0] if states else []

    def run():
        o, fin = fn(*leaves, gl, decay=decay, scale=0.7, initial_state=h0l, output_final_state=states,
                    backend="triton")
        outs = [o] + (list(fin) if states else [])
        return outs + list(torch.autograd.grad(outs, wrt, [do] + dfin))

    one_op = compose._one_op
    monkeypatch.setattr(compose, "_one_op", lambda *args: False)  # the separate passes
    want = run()
    calls = _spy_accumulating_backward(monkeypatch)
    monkeypatch.setattr(compose, "_one_op", one_op)
    got = run()
    assert calls == ONE_OP_CALLS[op]
    fields = len(ONE_OP_CALLS[op])
    # o, the final states; dq, dk, dv, dg, the initial states' gradients
    assert len(got) == len(want) == 4 + 2 * fields * states + (gl is not None)
    for i, (a, b) in enumerate(zip(got, want)):
        assert error_ratio(a, b) <= 1e-6, (i, error_ratio(a, b))


@pytest.mark.skipif(not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
def test_hla_one_op_only_where_it_applies(monkeypatch):
    """one_op leaves the separate passes to calls it does not cover: normalize, packed documents, fp32 keys wider
    than 64 (the first pass's backward is not one tile), and for hla3 fp32 values wider than 64 (its second pass's
    backward accumulates dq too; hla2 takes them); and linear_attn's chunk_bwd refuses the accumulation where its
    one-tile kernel does not run."""
    from hilo_kernels.linear_attn.triton_bwd import chunk_bwd
    from hilo_kernels.linear_attn.triton_fwd import Layout

    calls = _spy_accumulating_backward(monkeypatch)
    q, k, v, g = (x.float().to(FUSED_DEV).requires_grad_() for x in make(1, 80, 2, 16, 16, "weak", seed=53))
    for fn in (hla2_pos, hla3_pos):
        for kwargs in ({"normalize": True}, {"cu_seqlens": torch.tensor([0, 30, 80], device=FUSED_DEV)}):
            o, _ = fn(q, k, v, g, backend="triton", **kwargs)
            o.sum().backward()
        wide = [x.float().to(FUSED_DEV).requires_grad_() for x in make(1, 40, 1, 80, 16, "weak", seed=56)]
        o, _ = fn(*wide, backend="triton")
        o.sum().backward()
    wide_v = [x.float().to(FUSED_DEV).requires_grad_() for x in make(1, 40, 1, 16, 80, "weak", seed=57)]
    o, _ = hla3_pos(*wide_v, backend="triton")
    o.sum().backward()
    assert calls == []
    o, _ = hla2_pos(*wide_v, backend="triton")
    o.sum().backward()
    assert calls == ONE_OP_CALLS["hla2"]
    qf = torch.zeros(64, 1, 16)
    with pytest.raises(ValueError, match="one-tile backward"):  # grouped q / k: 1 group for 2 heads
        chunk_bwd(qf, qf, torch.zeros(64, 2, 16), None, torch.zeros(64, 2, 16), None, torch.zeros(1, 2, 16, 16),
                  1.0, None, Layout(1, 64, 2, None, "cpu"), False, dq_acc=torch.zeros(64, 2, 16))
    with pytest.raises(ValueError, match="K = V for self_values"):
        q2 = torch.zeros(64, 2, 16)
        chunk_bwd(q2, q2, torch.zeros(64, 2, 8), None, torch.zeros(64, 2, 8), None, torch.zeros(1, 2, 16, 8),
                  1.0, None, Layout(1, 64, 2, None, "cpu"), False, self_values=True)


@pytest.mark.skipif(not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("op", ["hla2", "hla3"])
def test_hla_one_op_compiles_into_one_graph(op):
    """The one op as a compiled model holds hla2 / hla3: "hilo::hla2_passes" / "hilo::hla3_passes" in one graph
    with eager's values and gradients, its fakes matching the real outputs."""
    from hilo_kernels.common.compile import compile_safe_operators
    from tests.kernels.compile_checks import assert_one_graph_with_eager_values

    traced = compile_safe_operators()[id({"hla2": hla2, "hla3": hla3}[op])]
    leaves = [x.float().to(FUSED_DEV).requires_grad_() for x in make(2, 70, 2, 16, 16, "weak", seed=54)]

    def f(q, k, v, g):
        o, _ = traced(q, k, v, g=g, backend="triton")
        return o.float().square().sum()

    assert_one_graph_with_eager_values(f, leaves, f"{op}_passes", rtol=1e-4, atol=1e-5)
