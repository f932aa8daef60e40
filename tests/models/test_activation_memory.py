"""Activation memory (CPU): benchmarks/activation_memory.py's saved-tensor account, the bytes per token the shells
save for the backward under bf16 autocast (bounds measured after the shell rewrites that cut them), and the
hand-written backwards those rewrites added, each against an independent definition."""

import json

import pytest
import torch
from torch import nn

from benchmarks.activation_memory import KERNEL_OP, SavedTensorAccount, main, measure, per_token_shape, summarize
from models import build_model
from models.casts import ProjectionInput
from models.conv import ShortConv
from models.mlp import SwiGLU
from models.norms import RMSNorm

VOCAB, T = 97, 64
BASE = {"vocab_size": VOCAB, "hidden_size": 64, "num_layers": 2, "num_heads": 4}
CONFIGS = {
    "transformer": {"mixer": "attention"},
    "mamba2": {"mixer": "mamba2", "mixer_kwargs": {"head_dim": 16, "state_size": 16}},
    "hla_mamba2": {"mixer": "mamba2", "operator": "hla2", "mixer_kwargs": {"head_dim": 16, "state_size": 16}},
    "gated_deltanet": {"mixer": "gated_deltanet", "mixer_kwargs": {"head_dim": 32, "num_heads": 2}},
}


def tiny(name: str):
    torch.manual_seed(0)
    return build_model({**BASE, **CONFIGS[name]})


def ids():
    return torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(0))


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 8)

    def forward(self, x):
        y = self.proj(x)  # the Linear saves x (and its weight)
        a, b = y.chunk(2, dim=-1)  # two views of y's one storage
        return (a.sin() * b.cos()).sum()  # sin saves a, cos saves b; the product saves sin(a) and cos(b)


def test_account_counts_each_storage_once_and_attributes_it_to_the_running_module():
    model = Toy()
    x = torch.randn(5, 6, requires_grad=True)  # so the Linear keeps its weight too
    with SavedTensorAccount(model) as account:
        model(x)
    acts = [r for r in account.records if r.kind == "activation"]
    # x (5 x 6), y (5 x 8, saved twice as two views: once), sin(a) and cos(b) (5 x 4 each), fp32
    assert sorted(r.nbytes for r in acts) == sorted([4 * 30, 4 * 40, 4 * 20, 4 * 20])
    assert account.saves > len(account.records)
    assert [r.module for r in acts if r.nbytes == 4 * 30] == ["proj"]
    assert [r.module for r in acts if r.nbytes == 4 * 40] == ["<model>"]
    params = [r for r in account.records if r.kind == "parameter"]
    assert [r.nbytes for r in params] == [4 * 48]  # the weight (as the transposed view addmm keeps)


def test_per_token_shape():
    assert per_token_shape((1, 512, 2048), 512) == "[2048]"
    assert per_token_shape((8, 64, 3, 256), 512) == "[T, 3, 256]"
    assert per_token_shape((1, 2304, 515), 512) == "[2304, T+3]"
    assert per_token_shape((3, 256, 256), 512).startswith("fixed")


def test_measure_a_tiny_mamba2():
    model = tiny("mamba2")
    result = measure(model, ids(), "autocast-bf16")
    acts = [r for r in result["records"] if r.kind == "activation"]
    s = summarize(result)
    assert s["all"] == pytest.approx(sum(r.nbytes for r in acts) / T)
    assert s["shell"] > 0 and s["kernel"] > 0 and s["outside"] > 0
    assert s["per_layer"] == pytest.approx(s["shell"] + s["kernel"])
    assert any(r.site == KERNEL_OP for r in acts)
    assert any(".mixer" in e["module"] for e in s["top"])
    assert all(e["module"].startswith("model.layers.*.") for e in s["top"])
    # one entry per module unless kernel_detail: the mixer's operator and its short conv (hilo_kernels.short_conv)
    kernel_entries = [e for e in s["top"] if e["site"] == KERNEL_OP]
    assert [e["shape"] for e in kernel_entries] == ["(all)", "(all)"]
    assert sorted(e["module"].rsplit(".", 1)[-1] for e in kernel_entries) == ["conv", "mixer"]
    assert len([e for e in summarize(result, kernel_detail=True)["top"] if e["site"] == KERNEL_OP]) > 1
    # autocast's bf16 weights are kept apart from the per-token numbers (with the fused loss's fp32 LM-head
    # gradient, which float32 has too)
    assert s["weight_shaped"] > summarize(measure(model, ids(), "float32"))["weight_shaped"] > 0


def test_main_prints_the_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "rows.json"
    rows = main(["--families", "mamba2", "--size", "tiny", "--seq-len", "32", "--top", "3", "--json", str(path)])
    assert [r["family"] for r in rows] == ["mamba2"]
    assert [r["family"] for r in json.loads(path.read_text())] == ["mamba2"]
    text = capsys.readouterr().out
    assert "| mamba2 | tiny |" in text and "kernel op" in text


# Saved bytes per token per layer outside the operators ("shell"), bf16 autocast, fp32 weights, the tiny configs
# above at T = 64. Before -> after the rewrites: transformer 3656 -> 1864, mamba2 5484.25 -> 3308.25, hla_mamba2
# 6124.25 -> 3324.25, gated_deltanet 6112.25 -> 3424.25. They came from: RMSNorm keeping an fp32 copy of its
# normalized input, SwiGLU keeping SiLU(gate) and the down projection's input, ShortConv keeping its concatenated
# input and pre-activation, one bf16 copy of the layer input per projection (GDN, attention), and hla_mamba2
# normalising B and C after repeating them to every head.
SHELL_BOUNDS = {"transformer": 1864, "mamba2": 3308.25, "hla_mamba2": 3324.25, "gated_deltanet": 3424.25}


@pytest.mark.parametrize("name", sorted(SHELL_BOUNDS))
def test_shell_saved_bytes_per_token_stay_under_the_measured_bound(name):
    s = summarize(measure(tiny(name), ids(), "autocast-bf16"))
    assert s["shell"] <= SHELL_BOUNDS[name], s["top"]


def test_norm_and_mlp_keep_only_their_inputs():
    """Per token and layer of the tiny mamba2 (hidden 64, intermediate 256): each RMSNorm keeps its fp32 input and
    one fp32 rstd; the MLP its bf16 input and gate_up output."""
    result = measure(tiny("mamba2"), ids(), "autocast-bf16")
    per = {}
    for r in result["records"]:
        if r.kind == "activation" and r.in_layer:
            key = r.pattern.removeprefix("model.layers.*.").split(".")[0]
            per[key] = per.get(key, 0) + r.nbytes / T / BASE["num_layers"]
    assert per["mixer_norm"] == per["mlp_norm"] == 4 * 64 + 4
    assert per["mlp"] == 2 * 64 + 2 * 2 * 256


# ---- the rewritten pieces against independent definitions ----------------------------------------------------


def test_rms_norm_gradients_match_the_definition():
    torch.manual_seed(0)
    norm = RMSNorm(24, eps=1e-5)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(24))
    x = torch.randn(3, 7, 24, requires_grad=True)
    dy = torch.randn(3, 7, 24)
    gx, gw = torch.autograd.grad((norm(x) * dy).sum(), (x, norm.weight))
    xd, wd = x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    ref = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * wd
    rx, rw = torch.autograd.grad((ref * dy.double()).sum(), (xd, wd))
    torch.testing.assert_close(gx.double(), rx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw.double(), rw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel_size, bias, activation", [(4, True, "silu"), (3, False, None), (2, True, None)])
def test_short_conv_gradients(kernel_size, bias, activation):
    """Every gradient (input, state, weight, bias) against finite differences, in float64."""
    torch.manual_seed(0)
    conv = ShortConv(5, kernel_size, bias=bias, activation=activation).double()
    x = torch.randn(2, 9, 5, dtype=torch.float64, requires_grad=True)
    state = torch.randn(2, 5, kernel_size - 1, dtype=torch.float64, requires_grad=True)
    names = [n for n, _ in conv.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in conv.parameters()]

    def f(x, state, *ps):
        return torch.func.functional_call(conv, dict(zip(names, ps, strict=True)), (x, state))[0]

    assert torch.autograd.gradcheck(f, (x, state, *params))


def test_swiglu_gradients():
    torch.manual_seed(0)
    mlp = SwiGLU(6, 10).double()
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    gu, down = mlp.gate_up_proj.weight, mlp.down_proj.weight
    dy = torch.randn(2, 5, 6, dtype=torch.float64)
    grads = torch.autograd.grad((mlp(x) * dy).sum(), (x, gu, down))
    gate, up = (x @ gu.T).chunk(2, -1)
    ref = (gate * torch.sigmoid(gate) * up) @ down.T
    torch.testing.assert_close(grads, torch.autograd.grad((ref * dy).sum(), (x, gu, down)))
    assert torch.autograd.gradcheck(lambda x: mlp(x), (x,))


class ThreeProjections(nn.Module):
    def __init__(self, shared: bool):
        super().__init__()
        self.shared = shared
        self.q, self.k, self.v = nn.Linear(16, 8, bias=False), nn.Linear(16, 8, bias=False), nn.Linear(16, 4)

    def forward(self, hidden):
        x = ProjectionInput(hidden) if self.shared else (lambda: hidden)
        return torch.cat([self.q(x()), self.k(x()), self.v(x())], -1)


def test_projection_input_shares_one_autocast_copy_with_the_same_gradients():
    torch.manual_seed(0)
    plain = ThreeProjections(shared=False)
    shared = ThreeProjections(shared=True)
    shared.load_state_dict(plain.state_dict())
    base = torch.randn(2, 11, 16)
    grads, copies = [], []
    for model in (plain, shared):
        hidden = base.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16), SavedTensorAccount(model) as account:
            out = model(hidden * 1.5)
        out.float().pow(2).sum().backward()
        grads.append([hidden.grad, *(p.grad for p in model.parameters())])
        copies.append(sum(1 for r in account.records if r.kind == "activation" and r.dtype == "bfloat16"
                          and r.nbytes == 2 * base.numel()))
    assert copies == [3, 1]
    for a, b in zip(*grads, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # without autocast it hands the input itself to every projection
    hidden = torch.randn(2, 3, 16)
    assert ProjectionInput(hidden)() is hidden


@pytest.mark.skipif(not __import__("os").environ.get("TRITON_INTERPRET") and not torch.cuda.is_available(),
                    reason="the Triton backend needs CUDA or TRITON_INTERPRET=1")
def test_mamba2_keeps_b_and_c_per_group_for_the_triton_backward(monkeypatch):
    """With linear_attn's Triton backend, Mamba-2 hands it B and C per group and the kernel op keeps those for the
    backward: 2 * (H - G) * N bf16 values per token and layer fewer than when they are repeated to every head."""
    from models.mixers.mamba2 import Mamba2Mixer

    # the Triton backend takes CUDA tensors, or CPU ones only under the interpreter (which CI sets without a GPU)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def kernel_bytes(grouped: bool) -> float:
        monkeypatch.setattr(Mamba2Mixer, "GROUPED_OPERATOR", grouped)
        torch.manual_seed(0)
        cfg = {**BASE, **CONFIGS["mamba2"]}
        model = build_model({**cfg, "mixer_kwargs": {**cfg["mixer_kwargs"], "backend": "triton"}}).to(device)
        return summarize(measure(model, ids().to(device), "autocast-bf16"))["kernel"]

    heads, groups, state = 2 * 64 // 16, 1, 16  # expand 2 x hidden 64 / head_dim 16; n_groups 1; state_size 16
    saved = kernel_bytes(False) - kernel_bytes(True)
    assert saved == pytest.approx(2 * (heads - groups) * state * 2)
