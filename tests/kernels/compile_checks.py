"""The kernels' torch.library custom ops under torch.compile: one shared check for their tests."""

import torch
from torch._dynamo.testing import CompileCounterWithBackend


def assert_one_graph_with_eager_values(f, leaves, op_name: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """torch.compile(f, fullgraph=True) captures one graph that holds torch.ops.hilo.<op_name>, and f's value and
    its gradients with respect to leaves equal eager's."""
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
