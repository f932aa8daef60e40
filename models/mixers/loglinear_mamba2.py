"""Log-linear Mamba-2 mixer (the mamba2 shell with operator hilo_kernels.loglinear_attn; docs/kernels.md)."""

from typing import ClassVar

from hilo_kernels.loglinear_attn import LogLinearState, loglinear_attn, loglinear_attn_step
from models.levels import (
    FlagsLevelParameter,
    decode_levels,
    level_parameter,
    level_scales,
    read_level_state,
    trained_levels,
    write_level_state,
)
from models.mixers.mamba2 import Mamba2Mixer
from models.registry import register_mixer


@register_mixer("loglinear_mamba2")
class LogLinearMamba2Mixer(FlagsLevelParameter, Mamba2Mixer):
    """Mamba-2 whose SSD scan is log-linear attention: the shell of Mamba2Mixer (same options and parameters)
    with in_proj -> [z | x, B, C | dt | dl] and, per head h with positions t, s counted from 0 in each document,

        y_t = sum_{s <= t} lambda_t[l(t, s)] exp(G_t - G_s) (C_t . B_s) dt_s x_s + D x_t,   l(t, s) = bit_length(t XOR s)

    i.e. loglinear_attn(q=C, k=B, v=x*dt, g=A*dt, level_scales=lambda, scale=1), with
    lambda_t[l] = softplus(L[h, l] * dl_t[h, l]) (models.levels): dl the last num_heads * num_levels outputs of
    in_proj, L [num_heads, num_levels] initialised to ones and excluded from weight decay, num_levels =
    bit_length(config.max_position_embeddings - 1) + 1. With every lambda equal to 1 it is Mamba2Mixer.

    Past the trained maximum: positions p >= max_position_embeddings need bit_length(p) + 1 levels; the levels
    beyond num_levels - 1 use level num_levels - 1's scale (clamped), so longer sequences and decoding work.

    Options: Mamba2Mixer's; backend is loglinear_attn's (None: Triton on CUDA, the chunked path otherwise;
    "triton", "torch", "naive").

    Cache slot: "conv_state" as Mamba2Mixer, and the per-level state "recurrent_levels" ([B, H, levels, N, P]
    fp32) with "recurrent_tokens" ([B] int64, tokens consumed): levels = bit_length(last position) + 1, grown by
    one each time a position reaches a power of two (O(log T) memory and time per decoded token).
    """

    GROUPED_OPERATOR: ClassVar[bool] = False  # the operator takes B and C per head

    NAME: ClassVar[str] = "loglinear_mamba2"

    def __init__(self, config, layer_idx: int):
        levels = trained_levels(config.max_position_embeddings)
        super().__init__(config, layer_idx, num_levels=levels)
        self.num_levels = levels
        self.L = level_parameter(self.num_heads, levels)

    def _mix(self, cm, bm, v, g, dl, cache, cu_seqlens):
        """loglinear_attn over (q=C, k=B, v, g) with lambda from dl; with a cache it continues and stores the
        slot's per-level state, growing it to the levels this call's positions reach."""
        b, t, h, p = v.shape
        slot = cache[self.layer_idx] if cache is not None else None
        state = read_level_state(slot)
        levels = decode_levels(state, t, cache, cu_seqlens)
        if state is not None:
            levels = max(levels, state.levels.shape[2])
            state = state.grow(levels)
        lam = level_scales(self.L, dl, levels)
        if slot is not None and t == 1 and cu_seqlens is None:
            if state is None:
                state = LogLinearState.empty(b, h, self.state_size, p, levels, device=v.device)
            y, state = loglinear_attn_step(cm[:, 0], bm[:, 0], v[:, 0], g=g[:, 0], level_scales=lam[:, 0], state=state,
                                           scale=1.0)
            y = y.unsqueeze(1)
        else:
            y, state = loglinear_attn(cm, bm, v, g=g, level_scales=lam, scale=1.0, initial_state=state,
                                      output_final_state=slot is not None, cu_seqlens=cu_seqlens,
                                      backend=self.backend)
        if slot is not None:
            write_level_state(slot, state)
        return y

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the chunked log-linear scan (chunk C = min(64, seq_len)) and the conv (the
        projections, dl included, count as 6 x their params in the model's total).

        Forward, per head and token, with K = state_size and V = head_dim: levels 0..6 are the dense in-chunk
        block, C^T B scores 2CK and their lambda-masked product with the values 2CV; the chunk's own state write
        B^T V 2KV; and J = max(0, bit_length(seq_len - 1) - 6) = ceil(log2(seq_len / C)) chunk-level passes
        (levels 7..), each reading its K x V state, 2KV: 2C(K + V) + 2KV(1 + J). Elementwise work (decays, masks,
        softplus) is not counted. The backward is counted as twice the forward (3x in all).
        """
        c = min(64, seq_len)
        k, v = self.state_size, self.head_dim
        passes = max(0, (seq_len - 1).bit_length() - 6)
        return float(3 * self.num_heads * (2 * c * (k + v) + 2 * k * v * (1 + passes)) + self.conv.flops_per_token())
