"""trainer.compile on CPU: compiled blocks compute what the eager ones do (loss and every gradient), the kernels'
operators stay out of the graphs (a graph break at each call, never traced), evaluation and decoding stay eager,
and checkpoints move between compiled and eager runs.

Inductor compiles (C++ on CPU) cost tens of seconds cold, so the Mamba-2 checks use inductor at the shapes of the
train.py run (the second compile of the same graphs is a cache hit) and the other families use aot_eager, which
runs the same dynamo capture, graph breaks and AOT autograd without code generation.
"""
import copy
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import models
from models.conv import ShortConv
from models.mlp import SwiGLU
from models.norms import GatedRMSNorm, RMSNorm
from tests.training.helpers import metrics, run_train, small_cfg
from training import CompileUnavailableError, ConfigError, compile_blocks, validate_train_config

# The tiny preset (conf/model/size/tiny.yaml) with small heads (the chunked CPU operators dominate a CPU step);
# the Mamba-2 model is the one test_train_compiled_then_resume_eager trains (MAMBA2_OVERRIDES).
TINY = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "vocab_size": 256, "max_position_embeddings": 1024}
SMALL_HEADS = {"head_dim": 32, "state_size": 16}
MIXERS = {"transformer": {"mixer": "attention"}, "mamba2": {"mixer": "mamba2", "mixer_kwargs": SMALL_HEADS},
          "gated_deltanet": {"mixer": "gated_deltanet", "mixer_kwargs": {"head_dim": 32}}}
MAMBA2_OVERRIDES = ["model=mamba2", *(f"model.mixer_kwargs.{k}={v}" for k, v in SMALL_HEADS.items())]
OPERATOR = {"mamba2": "linear_attn", "gated_deltanet": "delta_rule", "loglinear_mamba2": "loglinear_attn",
            "hla_transformer": "hla_fused"}
BATCH, SEQ = 4, 64  # tests.training.helpers.SMALL's rows


def _mixer(family):
    """MIXERS' entry, or the log-linear Mamba-2 / HLA (hla2, with decay) block's."""
    return MIXERS.get(family) or {
        "loglinear_mamba2": {"mixer": "loglinear_mamba2", "mixer_kwargs": SMALL_HEADS},
        "hla_transformer": {"mixer": "attention", "operator": "hla2", "mixer_kwargs": {"decay": True}}}[family]


def _model(family):
    torch.manual_seed(0)
    return models.build_model({**TINY, **MIXERS[family]})


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, return_logits=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _graph_breaks() -> dict[str, int]:
    """Graph breaks since counters were cleared: reason's first line (and the function it names) -> count."""
    out = {}
    for reason, n in counters["graph_break"].items():
        named = re.search(r"function `<function (\w+) at", reason)
        key = reason.splitlines()[0] + (f" [{named.group(1)}]" if named else "")
        out[key] = out.get(key, 0) + n
    return out


@pytest.mark.parametrize("family", ["transformer", "mamba2", "gated_deltanet"])
def test_compiled_blocks_match_eager_and_operators_stay_opaque(family):
    eager = _model(family)
    compiled = copy.deepcopy(eager)
    backend = "inductor" if family == "mamba2" else CompileCounterWithBackend("aot_eager")
    counters.clear()
    assert compile_blocks(compiled, backend=backend) == TINY["num_layers"]
    ids = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads = _loss_and_grads(eager, ids)
    graphs = None
    for _ in range(2):
        loss, grads = _loss_and_grads(compiled, ids)
        assert _rel(loss, ref_loss) < 1e-5, (loss, ref_loss)
        for name, g in grads.items():
            assert _rel(g, ref_grads[name]) < 1e-5, name
        # the compiled path ran: every block kind compiles once, whatever the number of layers, and the second step
        # runs the cached graphs (no recompilation)
        assert counters["stats"]["unique_graphs"] >= 1 and graphs in (None, counters["stats"]["unique_graphs"])
        graphs = counters["stats"]["unique_graphs"]
    breaks = _graph_breaks()
    if family == "transformer":  # softmax_attn without cu_seqlens is traced: a block is one graph, SDPA one node
        assert breaks == {} and graphs == 1, breaks
        assert "scaled_dot_product_attention" in backend.graphs[0].code
    else:  # graph breaks only at the operator (wrapped in torch.compiler.disable), nothing else; dynamo may count
        # that one break twice (GDN: the call sits in a loop over value blocks, below the compile-safe wrapper's frame)
        assert list(breaks) == [f"Skip calling `torch.compiler.disable()`d function [{OPERATOR[family]}]"], breaks
        if hasattr(torch._dynamo.config, "nested_graph_breaks"):
            assert graphs == 2  # before and after the operator call
    # evaluation (no_grad) and decoding (a cache) run the eager forward: no new graphs
    with torch.no_grad():
        assert torch.allclose(compiled(input_ids=ids, labels=ids).loss, eager(input_ids=ids, labels=ids).loss,
                              rtol=1e-5)
    compiled.eval()
    prompt = ids[:1, :8]
    out = compiled.generate(prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, eager.eval().generate(prompt, max_new_tokens=4, do_sample=False))
    assert counters["stats"]["unique_graphs"] == graphs
    assert list(compiled.state_dict()) == list(eager.state_dict())  # no _orig_mod. prefixes


@pytest.mark.parametrize("family", ["mamba2", "gated_deltanet", "loglinear_mamba2", "hla_transformer"])
def test_triton_operator_is_one_node_of_the_block_graph(family):
    """With their Triton backends (the interpreter here, CUDA on a GPU) and fixed-length rows, linear_attn,
    delta_rule, loglinear_attn and the fused hla2 are torch.library custom ops that compile_blocks traces: a block is
    one graph with no break, and the compiled loss and gradients equal eager's."""
    mixer = _mixer(family)
    backend_name = "fused" if family == "hla_transformer" else "triton"
    # two layers: every block compiles to the same graph either way, and the interpreter runs half the kernels
    _assert_one_block_graph({**TINY, "num_layers": 2, **mixer,
                             "mixer_kwargs": {**mixer["mixer_kwargs"], "backend": backend_name}},
                            f"hilo.{OPERATOR[family]}", seed=4)


def _assert_one_block_graph(config, op_in_graph, seed):
    """compile_blocks (aot_eager) on the model of config: every block one graph with no break that holds
    op_in_graph, and the compiled loss and gradients equal eager's. On CUDA when there is one: there the Triton
    backends refuse CPU tensors (no interpreter)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    eager = models.build_model(config).to(dev)
    compiled = copy.deepcopy(eager)
    backend = CompileCounterWithBackend("aot_eager")
    counters.clear()
    compile_blocks(compiled, backend=backend)
    ids = torch.randint(0, TINY["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(seed)).to(dev)
    ref_loss, ref_grads = _loss_and_grads(eager, ids)
    loss, grads = _loss_and_grads(compiled, ids)
    assert _rel(loss, ref_loss) < 1e-5
    for name, g in grads.items():
        assert _rel(g, ref_grads[name]) < 1e-5, name
    assert _graph_breaks() == {} and backend.frame_count == 1
    assert op_in_graph in backend.graphs[0].code


def test_fused_projections_compile_into_the_block_graph():
    """model.fused_projections with trainer.compile: Gated DeltaNet's six projections as one matmul of stacked
    weights inside the one block graph, with its Triton delta_rule, and eager's loss and gradients."""
    mixer = _mixer("gated_deltanet")
    mixer = {**mixer, "mixer_kwargs": {**mixer["mixer_kwargs"], "backend": "triton"}, "fused_projections": True}
    _assert_one_block_graph({**TINY, "num_layers": 2, **mixer}, "hilo.delta_rule", seed=7)


def test_packed_documents_compile_once():
    """varlen packing: cu_seqlens changes length from batch to batch; that length is dynamic, so the graphs are not
    recompiled for each document layout, and the packed losses equal eager's."""
    eager = _model("mamba2")
    compiled = copy.deepcopy(eager)
    backend = CompileCounterWithBackend("aot_eager")
    compile_blocks(compiled, backend=backend)
    gen = torch.Generator().manual_seed(2)
    for bounds in ([0, 10, 30, 96], [0, 50, 60, 70, 96], [0, 7, 96]):
        cu = torch.tensor(bounds)
        ids = torch.randint(0, TINY["vocab_size"], (1, 96), generator=gen)
        ref = eager(input_ids=ids, labels=ids, cu_seqlens=cu).loss
        loss = compiled(input_ids=ids, labels=ids, cu_seqlens=cu).loss
        assert _rel(loss, ref) < 1e-5
    assert backend.frame_count <= 2 * (1 if hasattr(torch._dynamo.config, "nested_graph_breaks") else 4)


def test_train_compiled_then_resume_eager(tmp_path):
    """A compiled run (inductor) writes checkpoints with the eager model's keys; an eager run resumes from its
    step-1 checkpoint and reaches the compiled run's step 3 up to rounding (compiled and eager steps agree)."""
    compiled_dir, eager_dir = tmp_path / "compiled", tmp_path / "eager"
    # On the CPU on every machine: with CUDA the run would take linear_attn's custom op (no graph break) under bf16
    # autocast, which this test's graph-break count and fp32 tolerances do not describe.
    steps = [*MAMBA2_OVERRIDES, "trainer.max_steps=3", "trainer.save_every=1", "trainer.val_every=0",
             "trainer.val_batches=1", "trainer.device=cpu"]
    counters.clear()
    summary = run_train(small_cfg(*steps, "trainer.compile=true"), compiled_dir)
    assert summary["step"] == 3 and counters["stats"]["unique_graphs"] >= 2
    assert _graph_breaks() == {"Skip calling `torch.compiler.disable()`d function [linear_attn]": 1}
    ckpt = compiled_dir / "checkpoints"
    shutil.copytree(ckpt / "step_00000001", eager_dir / "checkpoints" / "step_00000001")
    (eager_dir / "checkpoints" / "latest").write_text("step_00000001")
    assert run_train(small_cfg(*steps, "trainer.compile=false"), eager_dir)["step"] == 3
    a = load_file(str(ckpt / "step_00000003" / "model" / "model.safetensors"))
    b = load_file(str(eager_dir / "checkpoints" / "step_00000003" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and not any("_orig_mod" in k for k in a)
    for k in a:
        assert _rel(a[k], b[k]) < 1e-4, k
    def losses(run_dir):
        return [r["train/loss"] for r in metrics(run_dir) if "train/loss" in r and r["step"] > 1]

    assert len(losses(eager_dir)) == 2 and losses(compiled_dir) == pytest.approx(losses(eager_dir), rel=1e-5)


def test_config_and_missing_compile_fail_clearly(monkeypatch):
    with pytest.raises(ConfigError, match="trainer.compile"):
        validate_train_config(small_cfg("trainer.compile=yes"))
    validate_train_config(small_cfg("trainer.compile=true"))
    # trainer.compile_mode: one of inductor's modes without CUDA graphs, and only with trainer.compile
    validate_train_config(small_cfg("trainer.compile=true", "trainer.compile_mode=max-autotune-no-cudagraphs"))
    with pytest.raises(ConfigError, match=r"trainer.compile_mode='reduce-overhead' is invalid: expected null, "
                                          r"default or max-autotune-no-cudagraphs"):
        validate_train_config(small_cfg("trainer.compile=true", "trainer.compile_mode=reduce-overhead"))
    with pytest.raises(ConfigError, match="trainer.compile_mode is set but trainer.compile is false"):
        validate_train_config(small_cfg("trainer.compile_mode=default"))
    with pytest.raises(ValueError, match="compile mode 'max-autotune': expected one of default, "
                                         "max-autotune-no-cudagraphs"):
        compile_blocks(_model("transformer"), mode="max-autotune")
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw["mode"]) or fn)
    compile_blocks(_model("transformer"), mode="max-autotune-no-cudagraphs")
    compile_blocks(_model("transformer"), mode="default")
    assert seen == ["max-autotune-no-cudagraphs"] * TINY["num_layers"] + [None] * TINY["num_layers"]
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    with pytest.raises(CompileUnavailableError, match="trainer.compile=false"):
        compile_blocks(_model("transformer"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled Triton custom ops under inductor)")
@pytest.mark.parametrize("family", ["mamba2", "gated_deltanet", "loglinear_mamba2", "hla_transformer", "transformer"])
def test_cuda_blocks_compile_to_one_graph_under_autocast(family):
    """What a GPU training run compiles: inductor, bf16 autocast, the Triton custom ops (and the short conv's)
    inside the block graphs. No graph break, no recompilation over three steps, eager's bf16 loss, and gradients as
    close to the fp32 eager ones as eager's bf16 gradients are (a gradient that sums terms of both signs, like
    A_log's or dt_bias', can lose a tenth of its digits to bf16 in either run; a wrong one is off by ~1). (torch 2.11
    could not trace torch.amp.is_autocast_available, asserted a gradient's strides against its op's fake, could not
    lower a searchsorted over a sliced tensor, and traced the norms' autograd.Functions into wrong gradients: each
    failed here, not on the CPU.)"""
    torch.manual_seed(0)
    mixer = _mixer(family)
    eager = models.build_model({**TINY, **mixer}).cuda()
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(compiled, backend="inductor")
    ids = torch.randint(0, TINY["vocab_size"], (2, 256), generator=torch.Generator().manual_seed(5)).cuda()
    _, fp32_grads = _loss_and_grads(eager, ids)
    fp32_grads = {name: g.clone() for name, g in fp32_grads.items()}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref_loss, ref_grads = _loss_and_grads(eager, ids)
        graphs = None
        for _ in range(3):
            loss, grads = _loss_and_grads(compiled, ids)
            assert graphs in (None, counters["stats"]["unique_graphs"])
            graphs = counters["stats"]["unique_graphs"]
    assert _graph_breaks() == {}, _graph_breaks()
    assert graphs == 1, graphs  # every block is the same graph
    assert _rel(loss.float(), ref_loss.float()) < 1e-2
    wrong = {}
    for name, g in grads.items():
        err, eager_err = _rel(g.float(), fp32_grads[name].float()), _rel(ref_grads[name].float(), fp32_grads[name].float())
        if err > 2 * eager_err + 2e-2:
            wrong[name] = (round(err, 4), round(eager_err, 4))
    assert not wrong, wrong  # name: (compiled's, eager's error against fp32), every wrong gradient at once


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_compiled_norms_and_mlp_give_eager_gradients(device):
    """RMSNorm, both GatedRMSNorm forms, SwiGLU and the ATen short conv (each an autograd.Function in eager mode)
    alone in a compiled graph, input an intermediate as in a block: the eager gradients of the input and every
    weight. On CUDA, torch 2.11 traced the norms' Functions into gradients with relative error 1.0 (aot_eager too);
    compiled code now runs their formulas through autograd. SwiGLU's was exact there; the conv's is not yet run."""
    torch.manual_seed(0)
    x0 = torch.randn(2, 8, 64, device=device)
    gate = torch.randn(2, 8, 64, device=device)
    cases = {"rms": RMSNorm(64), "gated_after": GatedRMSNorm(64, group_size=32),
             "gated_before": GatedRMSNorm(64, norm_before_gate=True), "swiglu": SwiGLU(64, 96),
             "conv_aten": ShortConv(64, 4, bias=True, backend="torch")}  # its autograd.Function, traced

    def grads(module, f):
        module.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        out = f(x)
        (out * torch.linspace(-1, 1, out.numel(), device=device).view_as(out)).sum().backward()
        return {"x": x.grad, **{n: p.grad for n, p in module.named_parameters()}}

    for name, module in cases.items():
        module.to(device)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.1 * torch.randn_like(p))
        gated, conv = name.startswith("gated"), name.startswith("conv")

        def fn(x, module=module, gated=gated, conv=conv):
            if conv:
                return module(x * 1.5)[0]
            return module(x * 1.5, gate) if gated else module(x * 1.5)

        torch._dynamo.reset()
        ref, got = grads(module, fn), grads(module, torch.compile(fn, backend="aot_eager", fullgraph=True))
        for key in ref:
            assert _rel(got[key], ref[key]) < 1e-5, (name, key, _rel(got[key], ref[key]))


def test_loglinear_gdn_compiled_glue_inside_compiled_blocks(monkeypatch):
    """loglinear_delta_rule is opaque to the blocks' compile (torch.compiler.disable), and its Triton path compiles
    its own per-chunk glue (the default on CUDA): that inner compile still happens inside the compiled blocks, and
    the model's loss and every gradient are eager's with the eager glue. (aot_eager for both compiles; on CPU the
    Triton path runs under the interpreter.)"""
    from hilo_kernels.loglinear_delta_rule import triton_bwd

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    eager = models.build_model({"hidden_size": 64, "num_layers": 2, "num_heads": 2, "vocab_size": 128,
                                "max_position_embeddings": 256, "mixer": "loglinear_gated_deltanet",
                                "mixer_kwargs": {"head_dim": 16, "backend": "triton"}}).to(dev)
    compiled = copy.deepcopy(eager)
    glue = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(triton_bwd, "GLUE_BACKEND", glue)
    monkeypatch.setattr(triton_bwd, "_COMPILED_GLUE", {})
    ids = torch.randint(0, 128, (2, 130), generator=torch.Generator().manual_seed(7)).to(dev)
    monkeypatch.setenv("HILO_LOGLINEAR_DELTA_GLUE", "eager")
    ref_loss, ref_grads = _loss_and_grads(eager, ids)
    ref_grads = {n: g.clone() for n, g in ref_grads.items()}
    monkeypatch.setenv("HILO_LOGLINEAR_DELTA_GLUE", "compiled")
    compile_blocks(compiled, backend="aot_eager")
    loss, grads = _loss_and_grads(compiled, ids)
    assert glue.frame_count == 2, glue.frame_count  # the glue's two parts, compiled from inside the blocks
    assert _rel(loss, ref_loss) < 1e-6
    for name, g in grads.items():
        assert _rel(g, ref_grads[name]) < 1e-5, name


def test_compiled_blocks_under_cpu_autocast_give_eager_gradients():
    """Under autocast a compiled Gated DeltaNet block (its projections share one autocast copy of their input
    through models.casts.ProjectionInput's alias cast) gives eager's bf16 loss and every gradient, up to bf16
    rounding. The CUDA test above checks the same on the GPU, where a compiled Mamba-2 once gave a wrong gradient."""
    eager = _model("gated_deltanet")
    compiled = copy.deepcopy(eager)
    backend = CompileCounterWithBackend("aot_eager")
    counters.clear()
    compile_blocks(compiled, backend=backend)
    ids = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref_grads = _loss_and_grads(eager, ids)
        loss, grads = _loss_and_grads(compiled, ids)
    assert backend.frame_count >= 1
    assert _rel(loss.float(), ref_loss.float()) < 1e-2
    for name, g in grads.items():
        assert _rel(g.float(), ref_grads[name].float()) < 5e-2, name
