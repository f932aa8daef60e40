"""The operators under torch.compile: opaque calls that dynamo never traces.

A compiled region that reaches an opaque operator ends its graph there, runs the operator eagerly with dynamo off
for the whole call (its Triton kernels and autograd.Function on CUDA, the chunked PyTorch path elsewhere; inputs
validated, cu_seqlens and dataclass states handled as in eager mode) and starts a new graph after it: a graph
break, not a trace of the kernel's host code. `opaque_to_compile` is torch.compiler.disable (recursive), so the
operators' Python never becomes part of a graph, whatever they take or return.

`compile_safe_operators()` maps each public operator of kernels (hilo_kernels.__all__) to the callable a compiled model
should hold instead: loglinear_delta_rule always opaque; linear_attn, delta_rule and loglinear_attn traced
when they take their Triton custom ops (fixed-length calls on CUDA; loglinear_attn also without states); hla2, ahla
and hla3 when they take custom ops (fixed-length calls without states: the fused kernels' op, or the composition of
linear_attn's ops with backend "triton", one of which is their default on CUDA), opaque otherwise;
softmax_attn traced (SDPA is one node of the graph) unless it gets cu_seqlens, whose per-document loop reads the
boundaries on the host (opaque then, so no graph specialises on them); short_conv always traced (its Triton path is a
torch.library custom op). `make_opaque_in(namespace)` swaps those
callables into a module's globals, and into the values of its module-level dicts (operator tables), so code that
imported an operator by name calls the compile-safe one. Both are idempotent; eager results are unchanged. (Swapping
at compile time, not decorating the entry points where they are defined, keeps eager calls free of the wrapper; a
decorated entry point would need no swap: opaque_to_compile leaves it as it is.)
"""

import functools
from collections.abc import Callable, MutableMapping

import torch

# Operators traced into the graph when called without cu_seqlens (and opaque with it).
TRACED_WITHOUT_CU_SEQLENS = ("softmax_attn",)
# Operators always traced: their Triton path is a torch.library custom op, one node of the graph (no break).
ALWAYS_TRACED = ("short_conv",)
# Operators whose Triton path without cu_seqlens is a custom op: traced there, opaque otherwise (their torch paths
# and packed documents read boundaries on the host). Those in STATELESS_CUSTOM_OP take it only without an initial
# or a final state (loglinear_attn: a prior's tokens are read on the host, its levels returned by torch code).
TRACED_AS_CUSTOM_OP = ("delta_rule", "linear_attn", "loglinear_attn", "hla2", "ahla", "hla3")
STATELESS_CUSTOM_OP = ("loglinear_attn", "hla2", "ahla", "hla3")
# The backends that run as custom ops, where not only "triton" (one of them is the default backend on CUDA): the HLA
# ops' fused kernels are one op, their "triton" composition a few of linear_attn's, traced together.
CUSTOM_OP_BACKENDS = {"hla2": ("fused", "triton"), "ahla": ("fused", "triton")}

_SAFE: dict[int, Callable] = {}  # id(operator) -> its compile-safe callable (one per operator, stable identity)


def opaque_to_compile(fn: Callable) -> Callable:
    """fn behind torch.compiler.disable: under torch.compile the call is a graph break and fn runs eagerly with
    dynamo off inside it. Idempotent; outside torch.compile it is fn plus a few microseconds."""
    if getattr(fn, "_opaque_to_compile", False):
        return fn
    wrapped = torch.compiler.disable(fn, recursive=True)
    wrapped._opaque_to_compile = True
    return wrapped


def traced_without_cu_seqlens(fn: Callable) -> Callable:
    """fn traced when cu_seqlens is None (or absent), opaque_to_compile(fn) when it is given."""
    opaque = opaque_to_compile(fn)

    @functools.wraps(fn)
    def wrapper(*args, cu_seqlens=None, **kwargs):
        if cu_seqlens is None:
            return fn(*args, **kwargs)
        return opaque(*args, cu_seqlens=cu_seqlens, **kwargs)

    wrapper._opaque_to_compile = True  # already compile-safe: not wrapped again
    return wrapper


def dense_outputs(fn: Callable) -> Callable:
    """A custom op's real implementation with every tensor it returns made contiguous. Its fake reports dense
    outputs, and an inductor graph asserts at run time that the strides it planned with are the real ones (a
    gradient computed through a transpose failed that assertion on the GPU). custom_op reads fn's signature through
    functools.wraps."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            return out.contiguous()
        return tuple(x.contiguous() for x in out)

    return wrapper


def unused_grads_stay_none(ctx, output: tuple[torch.Tensor, ...]) -> None:
    """For a custom op's setup_context: the gradients of outputs nothing downstream reads (the intermediates an op
    returns for its own backward, a final state not asked for) reach its backward as None. Autograd's default fills
    them with zeros, a write of the saved chunk states' whole size each backward. The backward then takes its first
    output's gradient through grad_or_zeros."""
    ctx.set_materialize_grads(False)
    ctx.first_output = (output[0].shape, output[0].dtype, output[0].device)


def grad_or_zeros(ctx, grad: torch.Tensor | None) -> torch.Tensor:
    """The gradient of the op's first output (see unused_grads_stay_none): zeros when nothing read that output."""
    if grad is not None:
        return grad
    shape, dtype, device = ctx.first_output
    return torch.zeros(shape, dtype=dtype, device=device)


def absent_grad(like: torch.Tensor) -> torch.Tensor:
    """A backward custom op's output for an input that has no gradient (an optional g or initial state left None):
    an empty fp32 tensor, a new one each time, since a custom op's outputs may not alias one another."""
    return like.new_empty(0, dtype=torch.float32)


def traced_as_custom_op(fn: Callable, stateless: bool = False, op_backends: tuple[str, ...] = ("triton",)) -> Callable:
    """fn traced when it will take its custom ops (no cu_seqlens; a backend of op_backends, or None on CUDA tensors
    that are not float64; stateless: also no initial_state and no output_final_state), opaque_to_compile(fn)
    otherwise."""
    opaque = opaque_to_compile(fn)

    @functools.wraps(fn)
    def wrapper(q, *args, cu_seqlens=None, backend=None, **kwargs):
        default = backend is None and q.is_cuda and q.dtype != torch.float64
        custom_op = cu_seqlens is None and (backend in op_backends or default)
        if stateless:
            custom_op = custom_op and kwargs.get("initial_state") is None and not kwargs.get("output_final_state")
        if custom_op:
            return fn(q, *args, backend=backend, **kwargs)
        return opaque(q, *args, cu_seqlens=cu_seqlens, backend=backend, **kwargs)

    wrapper._opaque_to_compile = True  # already compile-safe: not wrapped again
    return wrapper


def compile_safe_operators() -> dict[int, Callable]:
    """id(operator) -> compile-safe callable, for every public operator in hilo_kernels.__all__."""
    import hilo_kernels

    if not _SAFE:
        for name in hilo_kernels.__all__:
            fn = getattr(hilo_kernels, name)
            if name in ALWAYS_TRACED:
                continue
            if name in TRACED_AS_CUSTOM_OP:
                _SAFE[id(fn)] = traced_as_custom_op(fn, stateless=name in STATELESS_CUSTOM_OP,
                                                    op_backends=CUSTOM_OP_BACKENDS.get(name, ("triton",)))
            elif name in TRACED_WITHOUT_CU_SEQLENS:
                _SAFE[id(fn)] = traced_without_cu_seqlens(fn)
            else:
                _SAFE[id(fn)] = opaque_to_compile(fn)
    return _SAFE


def make_opaque_in(namespace: MutableMapping) -> list[str]:
    """Replace every kernels operator held in namespace (a module's __dict__), directly or as a value of one of
    its dicts, by its compile-safe callable; return the names replaced ("name" or "table[key]")."""
    safe = compile_safe_operators()
    replaced = []
    for name, value in list(namespace.items()):
        if callable(value) and id(value) in safe:
            namespace[name] = safe[id(value)]
            replaced.append(name)
        elif type(value) is dict:
            for key, item in list(value.items()):
                if callable(item) and id(item) in safe:
                    value[key] = safe[id(item)]
                    replaced.append(f"{name}[{key!r}]")
    return replaced
