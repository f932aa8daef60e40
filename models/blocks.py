"""The one Block shared by every hilo model."""

import torch
from torch import nn

from models.mlp import SwiGLU
from models.norms import RMSNorm
from models.registry import build_mixer


class Block(nn.Module):
    """x + mixer(RMSNorm(x)), then + SwiGLU(RMSNorm(.)) (pre-norm residual, SPEC §5).

    The mixer is config.layer_mixer(layer_idx) from the registry.
    """

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.mixer_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mixer = build_mixer(config.layer_mixer(layer_idx), config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        cache=None,
    ) -> torch.Tensor:
        hidden = hidden + self.mixer(self.mixer_norm(hidden), position_ids, cu_seqlens, cache)
        return hidden + self.mlp(self.mlp_norm(hidden))
