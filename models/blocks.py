"""The one Block shared by every hilo model."""

import torch
from torch import nn

from models.conv import ShortConv
from models.mlp import SwiGLU
from models.norms import RMSNorm
from models.registry import build_mixer

# Cache slot key of the pre-mixer conv's decoding state; mixers name their own states differently ("conv_state",
# "conv_q", "key", ...), so the Block and its mixer share the layer's slot.
PRE_CONV_STATE = "pre_conv_state"


class Block(nn.Module):
    """x + mixer(pre_conv(RMSNorm(x))), then + SwiGLU(RMSNorm(.)) (pre-norm residual).

    The mixer is config.layer_mixer(layer_idx) from the registry. config.pre_conv = K adds pre_conv, a depthwise
    causal ShortConv of kernel size K (no bias, no activation) on the mixer's input, as the short conv in front of
    every sequence mixer of the Based / Zoology MQAR models (None: no conv, the mixer sees the norm's output). Its
    last K-1 inputs are kept in the layer's cache slot under PRE_CONV_STATE for decoding; with cu_seqlens it
    restarts at every document. config.mlp = False drops the MLP half and its norm (mixer-only blocks).
    """

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.mixer_norm = RMSNorm(config.hidden_size, config.norm_eps)
        kernel = getattr(config, "pre_conv", None)
        self.pre_conv = ShortConv(config.hidden_size, kernel, bias=False, activation=None) if kernel else None
        self.mixer = build_mixer(config.layer_mixer(layer_idx), config, layer_idx)
        if getattr(config, "mlp", True):
            self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        else:
            self.mlp_norm = self.mlp = None

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        cache=None,
    ) -> torch.Tensor:
        x = self.mixer_norm(hidden)
        if self.pre_conv is not None:
            slot = cache[self.layer_idx] if cache is not None else None
            x, conv_state = self.pre_conv(x, slot.get(PRE_CONV_STATE) if slot is not None else None, cu_seqlens)
            if slot is not None:
                slot[PRE_CONV_STATE] = conv_state
        mixed = self.mixer(x, position_ids, cu_seqlens, cache)
        if self.mlp is None:
            return hidden + mixed
        x, hidden = self.mlp_norm.add_forward(mixed, hidden)
        return hidden + self.mlp(x)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token beyond 6 x the block's matmul parameters: the mixer's sequence mixing and the
        pre-mixer conv."""
        conv = self.pre_conv.flops_per_token() if self.pre_conv is not None else 0.0
        return float(self.mixer.flops_per_token(seq_len) + conv)
