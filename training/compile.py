"""trainer.compile: torch.compile of the decoder blocks for the training steps.

Each models.Block's forward is compiled (inductor, dynamic=False), so the shells' elementwise code (norms, gates,
activations, residual adds, casts) runs as fused kernels. How the kernels' operators enter the graphs
(hilo_kernels.common.compile): Triton paths that are torch.library custom ops are traced as one node each (short_conv
always; linear_attn, delta_rule and loglinear_attn for fixed-length rows on CUDA, and hla2 / ahla's fused backend
there without states), so a Mamba-2, GDN, log-linear Mamba-2 or HLA (hla2 / ahla) block on a GPU compiles to a single
graph; softmax_attn is traced (SDPA) except with cu_seqlens; every other call (loglinear_delta_rule, hla3, the torch
paths on CPU, packed documents) is a graph break around an eager call
with dynamo off (its Triton kernels and autograd.Function as in eager mode). Where torch has dynamo's nested_graph_breaks, tracing resumes inside the mixer
after such a call, so that Block compiles to two graphs (before and after its operator); otherwise a break also ends
the graphs of the enclosing frames (mixer method, mixer, Block), which gives more and smaller graphs.

Only training forwards run compiled: a Block call with gradients enabled and no decoding cache. Evaluation under
no_grad, generate() (a cache) and anything else run the eager forward, so changing evaluation lengths and decoding
steps never recompile. Training shapes are static (fixed seq_len and batch): every block of one kind shares one
compilation; packed documents (varlen) mark cu_seqlens' length dynamic, as it changes from batch to batch.
The compiled forward is set on each Block instance (no wrapper module), so state_dict keys, checkpoints and
resuming (compiled or not, either way) are unchanged.
"""
from __future__ import annotations

import contextlib
import types

import torch


class CompileUnavailableError(RuntimeError):
    """torch.compile cannot run here (this torch has no dynamo, or dynamo does not support this Python)."""


def check_compile_available() -> None:
    compile_fn = getattr(torch, "compile", None)
    dynamo = getattr(torch, "_dynamo", None)
    if compile_fn is None or dynamo is None:
        raise CompileUnavailableError(
            f"trainer.compile=true needs torch.compile, which torch {torch.__version__} does not have; "
            f"install torch >= 2.4 or set trainer.compile=false")
    if not dynamo.is_dynamo_supported():
        import sys

        raise CompileUnavailableError(
            f"trainer.compile=true: torch.compile (dynamo) does not support Python {sys.version.split()[0]} with "
            f"torch {torch.__version__}; set trainer.compile=false")


# torch.compile modes trainer.compile_mode takes: inductor's default, or its GEMM / kernel autotuning without CUDA
# graphs (a training step's allocations and the opaque operators between graphs rule CUDA graphs out).
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


def compile_blocks(model: torch.nn.Module, backend="inductor", mode: str | None = None) -> int:
    """Compile the training forward of every models.Block inside model (in place); return how many were set.

    Compiled code from earlier calls in this process is dropped first (torch._dynamo.reset()): all Blocks share
    one code object, whose cache of compiled variants is bounded (dynamo's recompile_limit), so a process training
    several models in turn (sweeps, benchmarks/train_throughput.py) must not keep the previous models' variants.
    backend: torch.compile's backend, a name or a callable ("inductor"; tests also use "aot_eager"). mode: one of
    COMPILE_MODES (None: "default"); "max-autotune-no-cudagraphs" benchmarks Triton GEMM templates against cuBLAS for
    every matmul shape of the block at the first step (minutes), then keeps the fastest.
    Raises CompileUnavailableError when torch.compile cannot run.
    """
    import sys

    from hilo_kernels.common.compile import make_opaque_in
    from models.blocks import Block

    if mode is not None and mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r}: expected one of {', '.join(COMPILE_MODES)} (trainer.compile_mode)")
    check_compile_available()
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    # Operators are called through the names they were imported under: swap the compile-safe ones into the models
    # package's modules (mixers and their helpers) and the modules of every class inside a block (a mixer
    # registered from another package).
    modules = {name for name in sys.modules if name.split(".")[0] == "models"}
    modules.update(cls.__module__ for block in blocks for sub in block.modules() for cls in type(sub).__mro__
                   if cls.__module__.split(".")[0] not in ("torch", "builtins"))
    for name in sorted(modules & sys.modules.keys()):
        make_opaque_in(vars(sys.modules[name]))
    torch._dynamo.reset()
    nested = (torch._dynamo.config.patch(nested_graph_breaks=True)
              if hasattr(torch._dynamo.config, "nested_graph_breaks") else contextlib.nullcontext())
    for block in blocks:
        eager = types.MethodType(type(block).forward, block)
        block.forward = _TrainingForward(eager, torch.compile(eager, dynamic=False, backend=backend,
                                                                      mode=None if mode == "default" else mode), nested)
    return len(blocks)


class _TrainingForward:
    """Block.forward for a compiled block: the compiled forward for training calls (gradients on, no cache), the
    eager one otherwise."""

    def __init__(self, eager, compiled, tracing_config):
        self.eager, self.compiled, self.tracing_config = eager, compiled, tracing_config

    def __call__(self, hidden, position_ids, cu_seqlens=None, cache=None):
        if cache is not None or not torch.is_grad_enabled():
            return self.eager(hidden, position_ids, cu_seqlens, cache)
        if cu_seqlens is not None:
            torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
        with self.tracing_config:  # read when dynamo (re)compiles, during the call
            return self.compiled(hidden, position_ids, cu_seqlens)
