"""SwiGLU feed-forward."""

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """y = W_down(SiLU(W_gate x) * (W_up x)); W_gate and W_up live in one matmul (gate_up_proj)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        # Writes into the residual stream: initialized with the 1/sqrt(2 * num_layers) scaled std.
        self.down_proj._is_residual_proj = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
