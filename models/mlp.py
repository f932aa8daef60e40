"""SwiGLU feed-forward."""

import torch
import torch.nn.functional as F
from torch import nn

from models.casts import autocast_dtype


class _SwiGLUDownFn(torch.autograd.Function):
    """F.linear(SiLU(gate) * up, weight) keeping only gate, up (views of one projection output) and the weight (in
    the matmul's dtype) for the backward, where h = SiLU(gate) * up is recomputed: autograd would also keep
    SiLU(gate) and h, two intermediate-sized tensors per layer. Autocast's casts are made by hand (those F.linear's
    autocast makes) and the backward runs the ops autograd's would (mm, mul, silu_backward), so the outputs and
    gradients are the same numbers."""

    @staticmethod
    def forward(ctx, gate, up, weight):
        h = F.silu(gate) * up
        dtype = autocast_dtype(h)
        w = weight.to(dtype)
        out = F.linear(h.to(dtype), w)  # every operand in autocast's dtype already: autocast casts nothing
        ctx.save_for_backward(gate, up, w)
        ctx.dtypes = (h.dtype, weight.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        gate, up, w = ctx.saved_tensors
        h_dtype, weight_dtype = ctx.dtypes
        silu = F.silu(gate)
        dout2d = dout.reshape(-1, dout.shape[-1])
        dweight = None
        if ctx.needs_input_grad[2]:
            h = (silu * up).to(w.dtype)
            # the product autograd's mm backward forms for a transposed (column-major) weight operand
            dweight = dout2d.t().mm(h.reshape(-1, h.shape[-1])).to(weight_dtype)
        dgate = dup = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            dh = dout2d.mm(w).view(*dout.shape[:-1], w.shape[1]).to(h_dtype)
            dgate = torch.ops.aten.silu_backward(dh * up, gate) if ctx.needs_input_grad[0] else None
            dup = dh * silu if ctx.needs_input_grad[1] else None
        return dgate, dup, dweight


class SwiGLU(nn.Module):
    """y = W_down(SiLU(W_gate x) * (W_up x)); W_gate and W_up live in one matmul (gate_up_proj).

    down_proj is an nn.Linear (its weight, init and checkpoint key) applied by _SwiGLUDownFn, which recomputes
    SiLU(W_gate x) * (W_up x) in the backward instead of keeping it."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        # Writes into the residual stream: initialized with the 1/sqrt(2 * num_layers) scaled std.
        self.down_proj._is_residual_proj = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return _SwiGLUDownFn.apply(gate, up, self.down_proj.weight)
