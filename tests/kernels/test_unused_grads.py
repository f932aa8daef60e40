"""The Triton ops' custom-op autograd leaves the gradients of outputs nothing reads as None: autograd's default would
fill zeros of every saved intermediate's size (the chunk states) each backward. Checked by logging the zero-fill
ops of a backward (TRITON_INTERPRET on CPU, fp32, small shapes), and by the gradients when only the final state is
read (the output's gradient is then None and taken as zeros)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hilo_kernels

ZERO_FILLS = {"aten.zeros.default", "aten.zeros_like.default", "aten.new_zeros.default", "aten.fill_.Scalar",
              "aten.zero_.default"}


class ZeroFills(TorchDispatchMode):
    """The element counts of the tensors that zero-fill ops make or fill."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) in ZERO_FILLS and isinstance(out, torch.Tensor):
            self.sizes.append(out.numel())
        return out


B, T, H, D = 2, 70, 2, 16  # two chunks of 64 per row


def inputs(seed=0, beta=False):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, generator=gen) for _ in range(3))
    q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    g = -0.3 * torch.rand(B, T, H, generator=gen)
    out = {"q": q, "k": k, "v": v, "g": g}
    if beta:
        out["beta"] = torch.rand(B, T, H, generator=gen)
    return {n: x.requires_grad_() for n, x in out.items()}


CALLS = {
    "linear_attn": lambda x, **kw: hilo_kernels.linear_attn(x["q"], x["k"], x["v"], g=x["g"], backend="triton", **kw),
    "delta_rule": lambda x, **kw: hilo_kernels.delta_rule(x["q"], x["k"], x["v"], beta=x["beta"], g=x["g"],
                                                     backend="triton", **kw),
    "hla2 (two passes)": lambda x, **kw: hilo_kernels.hla2(x["q"], x["k"], x["v"], g=x["g"], backend="triton", **kw),
    "hla3 (three passes)": lambda x, **kw: hilo_kernels.hla3(x["q"], x["k"], x["v"], g=x["g"], backend="triton", **kw),
    "ahla (fused)": lambda x, **kw: hilo_kernels.ahla(x["q"], x["k"], x["v"], g=x["g"], backend="fused", **kw),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_backward_fills_no_saved_state_with_zeros(name):
    x = inputs(beta=name == "delta_rule")
    o, _ = CALLS[name](x)
    with ZeroFills() as fills:
        o.sum().backward()
    # a chunk-state buffer holds at least one K x V state per chunk row: B * 2 chunks * H * D * D elements
    assert not [n for n in fills.sizes if n >= B * 2 * H * D * D], fills.sizes
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in x.values())


@pytest.mark.parametrize("name", list(CALLS))
def test_gradient_of_the_final_state_alone(name):
    """Only the final state is read: the output's gradient arrives as None, and the gradients are those of the
    same call with the output's gradient zero."""
    x, y = inputs(seed=1, beta=name == "delta_rule"), inputs(seed=1, beta=name == "delta_rule")
    _, final = CALLS[name](x, output_final_state=True)
    sum(f.sum() for f in final).backward() if isinstance(final, tuple) else final.sum().backward()
    o, final = CALLS[name](y, output_final_state=True)
    total = (sum(f.sum() for f in final) if isinstance(final, tuple) else final.sum()) + 0 * o.sum()
    total.backward()
    for n in x:
        torch.testing.assert_close(x[n].grad, y[n].grad)
