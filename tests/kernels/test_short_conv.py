"""hilo_kernels.short_conv: the naive oracle against a per-token loop written here, then the conv1d (torch) and Triton
(interpreter on CPU, fp32) backends against the oracle for the output and every gradient (x, weight, bias,
initial_state), with odd channel counts, K = 1..4, a state, packed documents and T shorter than K; the Triton op
inside a compiled graph (one graph, same numbers); input errors."""

import pytest
import torch
import torch.nn.functional as F
from compile_checks import assert_one_graph_with_eager_values

from hilo_kernels.common import error_ratio
from hilo_kernels.short_conv import short_conv

TOL = 1e-5
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs on the GPU, or on CPU under TRITON_INTERPRET=1


def loop_definition(x, weight, bias, state, starts, silu):
    """y[b, t] = act(bias + sum_lag weight[:, K-1-lag] * input(t - lag)), float64, token by token."""
    b, t, c = x.shape
    k = weight.shape[1]
    y = torch.zeros(b, t, c, dtype=torch.float64)
    for i in range(t):
        doc = max(s for s in starts if s <= i)
        for lag in range(k):
            src = i - lag
            if src >= doc:
                y[:, i] += weight[:, k - 1 - lag].double() * x[:, src].double()
            elif doc == 0 and src < 0 and state is not None:
                y[:, i] += weight[:, k - 1 - lag].double() * state[:, :, k - 1 + src].double()
    if bias is not None:
        y = y + bias.double()
    return F.silu(y) if silu else y


def make(b, t, c, k, bias, state, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, c, generator=g)
    w = torch.randn(c, k, generator=g)
    bb = torch.randn(c, generator=g) if bias else None
    st = torch.randn(b, c, k - 1, generator=g) if state else None
    return x, w, bb, st


def run(backend, x, w, bb, st, cu, silu, dtype=torch.float32):
    """Output and gradients of sum(y * dy); every input cast to dtype (None: as given)."""
    dev = DEV if backend == "triton" else "cpu"
    leaves = [None if z is None else (z if dtype is None else z.to(dtype)).to(dev).detach().requires_grad_()
              for z in (x, w, bb, st)]
    y = short_conv(leaves[0], leaves[1], leaves[2], initial_state=leaves[3],
                   cu_seqlens=None if cu is None else cu.to(dev), activation="silu" if silu else None, backend=backend)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(99)).to(y.device)
    grads = torch.autograd.grad((y.float() * dy).sum(), [z for z in leaves if z is not None])
    return [y.detach().cpu(), *(g.cpu() for g in grads)]


CASES = [  # b, t, c, k, bias, state, documents, silu
    (2, 37, 20, 4, True, True, None, True),
    (1, 70, 130, 3, False, False, [0, 1, 5, 40], True),
    (2, 5, 7, 1, True, True, None, False),
    (1, 100, 33, 4, True, False, [0, 64], False),
    (3, 2, 9, 4, False, True, None, True),  # T < K - 1: the state reaches every tap
    # several 32-token tiles: taps and the backward's shifted dpre rows cross tile edges, documents start on them
    (2, 97, 70, 4, True, True, None, True),
    (1, 130, 40, 4, True, False, [0, 31, 32, 64, 65, 100], True),
]


@pytest.mark.parametrize("case", CASES)
def test_naive_matches_loop_definition(case):
    b, t, c, k, bias, state, docs, silu = case
    x, w, bb, st = make(b, t, c, k, bias, state, seed=t)
    cu = None if docs is None else torch.tensor([*docs, t])
    y = short_conv(x.double(), w.double(), None if bb is None else bb.double(),
                   initial_state=None if st is None else st.double(), cu_seqlens=cu,
                   activation="silu" if silu else None, backend="naive")
    assert error_ratio(y, loop_definition(x, w, bb, st, docs or [0], silu)) <= 1e-6


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", CASES)
def test_backends_match_naive(backend, case):
    b, t, c, k, bias, state, docs, silu = case
    x, w, bb, st = make(b, t, c, k, bias, state, seed=t)
    cu = None if docs is None else torch.tensor([*docs, t])
    ref = run("naive", x, w, bb, st, cu, silu, torch.float64)
    got = run(backend, x, w, bb, st, cu, silu)
    names = ["y", "dx", "dweight"] + (["dbias"] if bias else []) + (["dstate"] if state else [])
    for name, a, r in zip(names, got, ref, strict=True):
        if r.numel():
            assert error_ratio(a, r) <= TOL, f"{backend} {case} {name}: {error_ratio(a, r)}"


# The SiLU's two forms (hilo_kernels/short_conv/triton.py): in the kernels (a dpre kernel, then the backward reads it)
# or as torch ops after a linear conv (graph); "auto" leaves the choice to the default rule (graph while compiling).
SILU_IN_GRAPH = {"split": False, "graph": True, "auto": None}


@pytest.fixture
def form(request):
    from hilo_kernels.common import launch_settings

    with launch_settings(short_conv={"silu_in_graph": SILU_IN_GRAPH[request.param]}):
        yield request.param


@pytest.mark.parametrize("form", ["split", "graph"], indirect=True)
@pytest.mark.parametrize("case", [c for c in CASES if c[-1]])
def test_triton_backward_forms_match_naive(form, case):
    """The SiLU backward in the kernels (dpre written, then read) and as torch ops after a linear conv (graph)."""
    b, t, c, k, bias, state, docs, silu = case
    x, w, bb, st = make(b, t, c, k, bias, state, seed=t + 1)
    cu = None if docs is None else torch.tensor([*docs, t])
    ref = run("naive", x, w, bb, st, cu, silu, torch.float64)
    got = run("triton", x, w, bb, st, cu, silu)
    names = ["y", "dx", "dweight"] + (["dbias"] if bias else []) + (["dstate"] if state else [])
    for name, a, r in zip(names, got, ref, strict=True):
        if r.numel():
            assert error_ratio(a, r) <= TOL, f"{form} {case} {name}: {error_ratio(a, r)}"


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[5]])
def test_triton_reads_strided_inputs_in_place(case, aligned):
    """x a column slice of a wider tensor (as Mamba-2's xBC is of its in_proj output): with rows on 16-byte
    boundaries the kernels read it through its strides, with no copy; otherwise the op copies it first. Either way
    exactly the dense input's output and gradients (the gradient of the wider tensor is zero outside the slice)."""
    from hilo_kernels.short_conv import triton as conv_triton

    b, t, c, k, bias, state, docs, silu = case
    x, w, bb, st = make(b, t, c, k, bias, state, seed=t + 2)
    cu = None if docs is None else torch.tensor([*docs, t], device=DEV)
    lo, width = (8, 4 * ((c + 8 + 11) // 4)) if aligned else (5, c + 13)  # fp32: 16 bytes are 4 columns
    wide = torch.randn(b, t, width, generator=torch.Generator().manual_seed(7))
    wide[:, :, lo:lo + c] = x
    outs = []
    for strided in (False, True):
        leaf = (wide if strided else x).to(DEV).requires_grad_()
        xin = leaf[:, :, lo:lo + c] if strided else leaf
        assert xin.is_contiguous() != strided
        assert (conv_triton._channels_dense(xin) is xin) == (aligned or not strided)
        others = [None if z is None else z.to(DEV).requires_grad_() for z in (w, bb, st)]
        y = short_conv(xin, others[0], others[1], initial_state=others[2], cu_seqlens=cu,
                       activation="silu" if silu else None, backend="triton")
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(8)).to(DEV)
        grads = torch.autograd.grad((y * dy).sum(), [leaf] + [z for z in others if z is not None])
        dx = grads[0][:, :, lo:lo + c] if strided else grads[0]
        if strided:
            assert not grads[0][:, :, :lo].any() and not grads[0][:, :, lo + c:].any()
        outs.append([y, dx, *grads[1:]])
    for a, r in zip(*outs, strict=True):
        assert torch.equal(a, r)


def test_triton_bf16_inputs_keep_their_dtype():
    x, w, bb, st = make(2, 50, 24, 4, True, True, seed=3)
    y = short_conv(x.bfloat16().to(DEV), w.to(DEV), bb.to(DEV), initial_state=st.bfloat16().to(DEV), backend="triton")
    assert y.dtype == torch.bfloat16
    y = y.cpu()
    ref = short_conv(x.bfloat16().double(), w.double(), bb.double(), initial_state=st.bfloat16().double(),
                     backend="naive")
    assert error_ratio(y, ref) <= 8e-3  # one bf16 rounding of the output


@pytest.mark.parametrize("form", ["split", "graph", "auto"], indirect=True)
def test_triton_op_compiles_into_one_graph(form):
    """One graph with eager's values and gradients, the SiLU in the kernels or (graph; auto under compile) as torch
    ops around the op."""
    x, w, bb, _ = make(2, 40, 24, 4, True, False, seed=4)

    def f(x, w, bb):
        y = short_conv(F.gelu(x) * 2, w, bb, backend="triton")
        return (y * y.sigmoid()).sum()

    leaves = [z.to(DEV).requires_grad_() for z in (x, w, bb)]
    assert_one_graph_with_eager_values(f, leaves, "short_conv")


@pytest.mark.parametrize("compiling", [False, True])
def test_auto_backward_form_follows_compilation(monkeypatch, compiling):
    """By default, while torch.compile traces, SiLU leaves the op for torch ops (graph), so inductor fuses it; in
    eager the op keeps it (split). Same values either way."""
    from hilo_kernels.short_conv import triton as conv_triton

    calls = []
    op = conv_triton._short_conv_op

    def spy(*args):
        calls.append(args[-1])
        return op(*args)

    monkeypatch.setattr(conv_triton, "_short_conv_op", spy)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    x, w, bb, _ = make(1, 30, 16, 4, True, False, seed=7)
    x, w, bb = x.to(DEV), w.to(DEV), bb.to(DEV)
    y = conv_triton.short_conv_triton(x, w, bb, None, None, True)
    assert calls == [not compiling]  # the op's own silu flag
    ref = short_conv(x.double(), w.double(), bb.double(), activation="silu", backend="naive")
    assert error_ratio(y.double().cpu(), ref.cpu()) <= TOL


def test_bad_inputs_raise_clear_errors():
    x, w, bb, st = make(1, 8, 6, 4, True, True, seed=5)
    with pytest.raises(ValueError, match=r"x must be a floating-point tensor \[B, T, C\]"):
        short_conv(x[0], w)
    with pytest.raises(ValueError, match=r"weight must be \[C=6, K\]"):
        short_conv(x, w[:5])
    with pytest.raises(ValueError, match=r"bias must be \[C=6\]"):
        short_conv(x, w, bb[:2])
    with pytest.raises(ValueError, match=r"initial_state must be \[B, C, K-1\]"):
        short_conv(x, w, initial_state=st[:, :, :2])
    with pytest.raises(ValueError, match="not both"):
        short_conv(x, w, initial_state=st, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="batch size 1"):
        short_conv(torch.randn(2, 8, 6), w, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="activation must be 'silu' or None"):
        short_conv(x, w, activation="relu")
    with pytest.raises(ValueError, match="unknown backend"):
        short_conv(x, w, backend="cudnn")


def test_cuda_default_backend_from_the_environment():
    import os
    import subprocess
    import sys

    env = dict(os.environ, HILO_SHORT_CONV="cudnn")
    bad = subprocess.run([sys.executable, "-c", "import hilo_kernels.short_conv"], env=env, capture_output=True, text=True,
                         check=False)
    assert bad.returncode != 0 and "HILO_SHORT_CONV='cudnn': expected 'triton' (the default) or 'torch'" in bad.stderr
    env["HILO_SHORT_CONV"] = "torch"
    ok = subprocess.run([sys.executable, "-c", "import sys, hilo_kernels; print(sys.modules['hilo_kernels.short_conv'].CUDA_DEFAULT)"], env=env,
                        capture_output=True, text=True, check=False)
    assert ok.returncode == 0 and ok.stdout.strip() == "torch", ok.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 Triton checks need a CUDA GPU")
@pytest.mark.parametrize("form", ["split", "graph"], indirect=True)
@pytest.mark.parametrize("docs", [None, [0, 1, 16, 300]])
def test_gpu_bf16_matches_fp32_oracle(docs, form):
    """On the GPU: bf16 inputs through the Triton kernels against the fp32 oracle (output 5e-3, gradients 1e-2),
    the SiLU in the kernels (split) or after them as torch ops (graph: one bf16 rounding more)."""
    t = 777
    x, w, bb, st = make(1 if docs else 2, t, 2304, 4, True, docs is None, seed=6)
    cu = None if docs is None else torch.tensor([*docs, t], device="cuda")
    x, w, bb = x.cuda(), w.cuda(), bb.cuda()
    st = None if st is None else st.cuda()
    got = run("triton", x.bfloat16(), w, bb, None if st is None else st.bfloat16(), cu, True, dtype=None)
    ref = run("naive", x.bfloat16().float(), w, bb, None if st is None else st.bfloat16().float(), cu, True)
    for i, (a, r) in enumerate(zip(got, ref, strict=True)):
        assert error_ratio(a, r) <= (5e-3 if i == 0 else 1e-2), i
