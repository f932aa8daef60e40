"""The kernels' torch.library custom ops under torch.compile: one shared check for their tests."""

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode


class _RecordHiloOps(TorchDispatchMode):
    """Records every call of a hilo:: custom op (forward and backward) with its real arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "hilo":
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def assert_fakes_match_real(f, leaves, op_name: str) -> None:
    """Each hilo custom op that f's forward and backward call has a fake that gives its real outputs' shapes,
    dtypes and strides (opcheck's test_faketensor): an inductor graph plans with the fake and asserts its strides
    against the real outputs at run time."""
    with _RecordHiloOps() as rec:
        torch.autograd.grad(f(*leaves), leaves)
    called = {func.name() for func, _, _ in rec.calls}
    assert {f"hilo::{op_name}", f"hilo::{op_name}_backward"} <= called, called
    for func, args, kwargs in rec.calls:
        torch.library.opcheck(func, args, kwargs, test_utils=("test_faketensor", "test_schema"))


def assert_one_graph_with_eager_values(f, leaves, op_name: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """torch.compile(f, fullgraph=True) captures one graph that holds torch.ops.hilo.<op_name>, and f's value and
    its gradients with respect to leaves equal eager's; the op's fakes match its real outputs."""
    assert_fakes_match_real(f, leaves, op_name)
    ref = f(*leaves)
    ref_grads = torch.autograd.grad(ref, leaves)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    out = torch.compile(f, backend=counter, fullgraph=True)(*leaves)
    grads = torch.autograd.grad(out, leaves)
    assert counter.frame_count == 1 and f"hilo.{op_name}" in counter.graphs[0].code
    assert torch.allclose(out, ref, rtol=rtol, atol=atol)
    for a, r in zip(grads, ref_grads, strict=True):
        assert torch.allclose(a, r, rtol=rtol, atol=atol)
