"""models.fused_norms (Triton; on CPU through the interpreter) against the torch code of models.norms: values and
every gradient of RMSNorm, residual-add + RMSNorm and the gated RMSNorm, and a tiny model with fused_norms on
against off."""

import os

import pytest
import torch

from models import HiloConfig, build_model
from models import fused_norms as fn
from models.norms import GatedRMSNorm, RMSNorm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton on CPU needs TRITON_INTERPRET=1 before import (tests/conftest.py)")
SHAPE = (3, 7)  # 21 rows: not a multiple of any row tile


def assert_rel(got, want, tol=1e-5):
    """max |got - want| <= tol * max |want| (and equal dtypes and shapes)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.double() - want.double()).abs().max().item()
    assert err <= tol * want.double().abs().max().item(), f"max error {err:.3g} vs scale {want.abs().max():.3g}"


def rand(*shape, dtype=torch.float32, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype).requires_grad_()


def with_weight(module, seed):
    module.weight.data = rand(module.weight.shape[0], seed=seed).detach()
    return module.to(DEVICE)


@pytest.mark.parametrize("dim", [64, 100])
def test_rms_norm_values_and_grads(dim):
    torch_norm = with_weight(RMSNorm(dim), seed=1)
    x, dy = rand(*SHAPE, dim, seed=2), rand(*SHAPE, dim, seed=3)
    want = torch_norm(x)
    want_grads = torch.autograd.grad(want, (x, torch_norm.weight), dy)
    got = fn.rms_norm(x, torch_norm.weight, torch_norm.eps)
    got_grads = torch.autograd.grad(got, (x, torch_norm.weight), dy)
    assert_rel(got, want)
    for g, w in zip(got_grads, want_grads):
        assert_rel(g, w)


@pytest.mark.parametrize("dim", [64, 100])
def test_add_rms_norm_values_and_grads(dim):
    """Both outputs (the normalized h and the new residual h) carry gradients, as in the Block."""
    torch_norm = with_weight(RMSNorm(dim), seed=1)
    x, residual = rand(*SHAPE, dim, seed=2), rand(*SHAPE, dim, seed=3)
    dy, dh = rand(*SHAPE, dim, seed=4), rand(*SHAPE, dim, seed=5)
    inputs = (x, residual, torch_norm.weight)
    h = residual + x
    want = torch_norm(h)
    want_grads = torch.autograd.grad((want, h), inputs, (dy, dh))
    got, got_h = fn.add_rms_norm(x, residual, torch_norm.weight, torch_norm.eps)
    got_grads = torch.autograd.grad((got, got_h), inputs, (dy, dh))
    assert_rel(got, want)
    assert_rel(got_h, h)
    for g, w in zip(got_grads, want_grads):
        assert_rel(g, w)


# group sizes as the mamba2 shell builds them: d_inner // n_groups for n_groups 1, 2 and 4
@pytest.mark.parametrize("dim", [64, 100])
@pytest.mark.parametrize("n_groups", [1, 2, 4])
@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_gated_rms_norm_values_and_grads(dim, n_groups, norm_before_gate):
    torch_norm = with_weight(GatedRMSNorm(dim, norm_before_gate=norm_before_gate, group_size=dim // n_groups), 1)
    x, dy = rand(*SHAPE, dim, seed=2), rand(*SHAPE, dim, seed=3)
    # the gate as the mamba2 mixer passes z: a column slice of a wider in_proj output (row stride > dim)
    gate = rand(*SHAPE, dim + 37, seed=4)[..., 5:5 + dim]
    inputs = (x, gate, torch_norm.weight)
    want = torch_norm(x, gate)
    want_grads = torch.autograd.grad(want, inputs, dy)
    got = fn.gated_rms_norm(x, gate, torch_norm.weight, torch_norm.eps, norm_before_gate, dim // n_groups)
    got_grads = torch.autograd.grad(got, inputs, dy)
    assert_rel(got, want)
    for g, w in zip(got_grads, want_grads):
        assert_rel(g, w)


def test_half_precision_inputs_keep_the_torch_dtypes():
    """bf16 branch output on an fp32 residual stream (bf16 autocast's Block), and bf16 gated-norm inputs: outputs
    and gradients in the torch code's dtypes, equal to it up to bf16 rounding."""
    dim = 100
    torch_norm = with_weight(RMSNorm(dim), seed=1)
    x, residual = rand(*SHAPE, dim, dtype=torch.bfloat16, seed=2), rand(*SHAPE, dim, seed=3)
    dy, dh = rand(*SHAPE, dim, seed=4).detach(), rand(*SHAPE, dim, seed=5).detach()
    inputs = (x, residual, torch_norm.weight)
    h = residual + x
    want = torch_norm(h)
    want_grads = torch.autograd.grad((want, h), inputs, (dy, dh))
    got, got_h = fn.add_rms_norm(x, residual, torch_norm.weight, torch_norm.eps)
    got_grads = torch.autograd.grad((got, got_h), inputs, (dy, dh))
    assert_rel(got, want)
    assert_rel(got_h, h)
    for g, w in zip(got_grads, want_grads):
        assert_rel(g, w, tol=1e-2)

    gated = with_weight(GatedRMSNorm(dim, group_size=50), seed=1)
    x, gate = rand(*SHAPE, dim, dtype=torch.bfloat16, seed=2), rand(*SHAPE, dim, dtype=torch.float16, seed=3)
    dy = rand(*SHAPE, dim, dtype=torch.bfloat16, seed=4).detach()
    inputs = (x, gate, gated.weight)
    want = gated(x, gate)
    want_grads = torch.autograd.grad(want, inputs, dy)
    got = fn.gated_rms_norm(x, gate, gated.weight, gated.eps, False, 50)
    got_grads = torch.autograd.grad(got, inputs, dy)
    assert_rel(got, want, tol=1e-2)
    for g, w in zip(got_grads, want_grads):
        assert_rel(g, w, tol=2e-2)


def test_use_triton_dispatch(monkeypatch):
    x = torch.zeros(2, 8, device=DEVICE)
    assert fn.use_triton(8, x, x)
    assert not fn.use_triton(8, x.double())  # fp64 checks keep the torch code
    assert not fn.use_triton(8, x[:0])
    assert not fn.use_triton(fn.MAX_GROUP_SIZE + 1, x)
    if DEVICE == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        assert not fn.use_triton(8, x)


def test_config_switch():
    assert HiloConfig().fused_norms is False
    with pytest.raises(TypeError, match="fused_norms"):
        HiloConfig(fused_norms="true")


@pytest.mark.parametrize("mixer, mixer_kwargs", [
    # hidden 50: d_inner 100 in two groups of 50, 4 heads of 25; layer 1 is softmax attention (5 heads of 10)
    ("mamba2", {"head_dim": 25, "state_size": 8, "n_groups": 2}),
    ("gated_deltanet", {"head_dim": 10, "num_heads": 2}),  # per-head norm (gate after the norm) over 20 channels
])
def test_model_with_fused_norms_equals_unfused(monkeypatch, mixer, mixer_kwargs):
    kinds = set()
    forward = fn._forward

    def recording_forward(x, residual, gate, *args):
        kinds.add((residual is not None, gate is not None))
        return forward(x, residual, gate, *args)

    monkeypatch.setattr(fn, "_forward", recording_forward)
    ids = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = build_model({"vocab_size": 61, "hidden_size": 50, "num_layers": 2, "num_heads": 5, "mixer": mixer,
                             "mixer_kwargs": mixer_kwargs, "attn_layers": [1], "fused_norms": fused})
        model = model.to(DEVICE).train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert kinds == {(False, False), (True, False), (False, True)}  # every kernel ran, only in the fused model
    (want_loss, want_grads), (got_loss, got_grads) = results
    assert_rel(got_loss, want_loss)
    assert want_grads.keys() == got_grads.keys()
    for name, want in want_grads.items():
        assert_rel(got_grads[name], want)


@pytest.mark.parametrize("norm", ["rms_norm", "add_rms_norm", "gated_rms_norm"])
def test_fused_norms_are_custom_ops_in_one_compiled_graph(norm):
    """Each fused norm is the torch.library op pair hilo::<norm> / hilo::<norm>_backward: torch.compile keeps the
    call as one node of a single graph (no trace of its host code, no break) with eager's values and gradients, and
    the fakes give the real outputs' shapes, dtypes and strides (opcheck), on a non-contiguous input and, for the
    residual form, mixed dtypes."""
    from tests.kernels.compile_checks import assert_one_graph_with_eager_values

    x = rand(4, 6, 100, seed=60)[:, ::2]  # [4, 3, 100] with a row stride of 200: a view, not a copy
    weight = rand(100, seed=61)
    if norm == "rms_norm":
        leaves = [x, weight]

        def f(x, w):
            return fn.rms_norm(x * 2, w, 1e-6).square().sum()
    elif norm == "add_rms_norm":
        leaves = [x, rand(4, 3, 100, dtype=torch.bfloat16, seed=62), weight]  # h, y in fp32; dr in bf16

        def f(x, r, w):
            y, h = fn.add_rms_norm(x * 2, r, w, 1e-6)
            return y.square().sum() + (h * 0.5).sum()
    else:
        leaves = [x, rand(4, 3, 100, seed=63), weight]

        def f(x, g, w):
            return fn.gated_rms_norm(x * 2, g, w, 1e-6, False, 25).square().sum()

    assert_one_graph_with_eager_values(f, leaves, norm, rtol=1e-5, atol=1e-5)
