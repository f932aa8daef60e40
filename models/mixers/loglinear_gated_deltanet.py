"""Log-linear Gated DeltaNet mixer (the gated_deltanet shell with hilo_kernels.loglinear_delta_rule; docs/kernels.md)."""

from typing import ClassVar

import torch
from torch import nn

from hilo_kernels.loglinear_attn import LogLinearState
from hilo_kernels.loglinear_delta_rule import loglinear_delta_rule, loglinear_delta_rule_step
from models.levels import (
    FlagsLevelParameter,
    decode_levels,
    level_parameter,
    level_scales,
    read_level_state,
    trained_levels,
    write_level_state,
)
from models.mixers.gated_deltanet import GatedDeltaNetMixer
from models.ops import value_blocks
from models.registry import register_mixer


@register_mixer("loglinear_gated_deltanet")
class LogLinearGatedDeltaNetMixer(FlagsLevelParameter, GatedDeltaNetMixer):
    """Gated DeltaNet whose delta rule is log-linear: the shell of GatedDeltaNetMixer (same options and
    parameters) plus a level projection l_proj, and per head, with positions t, s counted from 0 in each document,

        o_t = scale sum_{s <= t} lambda_t[l(t, s)] q_t^T P_{t<-s} beta_s k_s v_s^T,   l(t, s) = bit_length(t XOR s)
        P_{t<-s} = prod_{r = s+1..t} exp(g_r) (I - beta_r k_r k_r^T)

    i.e. loglinear_delta_rule(q, k, v, beta=beta, g=g, level_scales=lambda), with lambda_t[l] = softplus(L[h, l] *
    dl_t[h, l]) (models.levels): dl = l_proj(x) (num_heads * num_levels outputs), L [num_heads, num_levels]
    initialised to ones and excluded from weight decay, num_levels = bit_length(config.max_position_embeddings - 1)
    + 1. With every lambda equal to 1 it is GatedDeltaNetMixer.

    Past the trained maximum: positions p >= max_position_embeddings need bit_length(p) + 1 levels; the levels
    beyond num_levels - 1 use level num_levels - 1's scale (clamped), so longer sequences and decoding work.

    Options: GatedDeltaNetMixer's (value_block up to 512, the default); backend is loglinear_delta_rule's (None:
    Triton on CUDA, the chunked path elsewhere; "triton", "torch", "naive").

    Cache slot: "conv_q", "conv_k", "conv_v" as GatedDeltaNetMixer, and the per-level state "recurrent_levels"
    ([B, H, levels, K, V] fp32) with "recurrent_tokens" ([B] int64, tokens consumed): levels =
    bit_length(last position) + 1, grown by one each time a position reaches a power of two.
    """

    NAME: ClassVar[str] = "loglinear_gated_deltanet"

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.num_levels = trained_levels(config.max_position_embeddings)
        self.l_proj = nn.Linear(config.hidden_size, self.num_heads * self.num_levels, bias=False)
        self.L = level_parameter(self.num_heads, self.num_levels)

    def _mix(self, q, k, v, beta, g, x, cache, cu_seqlens):
        """loglinear_delta_rule with lambda from l_proj(x()) (x: the layer input as a models.casts.ProjectionInput),
        over value blocks of at most value_block columns (exact either way, as in GatedDeltaNetMixer); with a cache
        it continues and stores the slot's per-level state, grown to the levels this call's positions reach. A single decoding token takes the recurrent step, over all columns at once."""
        b, t, h, _ = q.shape
        slot = cache[self.layer_idx] if cache is not None else None
        state = read_level_state(slot)
        levels = decode_levels(state, t, cache, cu_seqlens)
        if state is not None:
            levels = max(levels, state.levels.shape[2])
            state = state.grow(levels)
        lam = level_scales(self.L, self.l_proj(x()), levels)
        if slot is not None and t == 1 and cu_seqlens is None:
            # the step is plain PyTorch with no head-dim limit: one call over all value columns (no slicing and
            # re-joining of the level states, a pass over all of them)
            if state is None:
                state = LogLinearState.empty(b, h, self.head_dim, self.head_v_dim, levels, device=q.device)
            o, state = loglinear_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta=beta[:, 0], g=g[:, 0],
                                                 level_scales=lam[:, 0], state=state)
            write_level_state(slot, state)
            return o.unsqueeze(1)
        outs, finals = [], []
        for lo, hi in value_blocks(self.head_v_dim, self.value_block):
            s0 = None if state is None else LogLinearState(state.levels[..., lo:hi], state.tokens)
            o, s1 = loglinear_delta_rule(q, k, v[..., lo:hi], beta=beta, g=g, level_scales=lam, initial_state=s0,
                                         output_final_state=slot is not None, cu_seqlens=cu_seqlens,
                                         backend=self.backend)
            outs.append(o)
            finals.append(s1)
        if slot is not None:
            write_level_state(slot, LogLinearState(torch.cat([s.levels for s in finals], -1), finals[0].tokens))
        return torch.cat(outs, -1) if len(outs) > 1 else outs[0]

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the chunked log-linear delta rule (chunk C = min(64, seq_len)) and the three
        convs (projections, l_proj included, count as 6 x their params in the model's total).

        Forward, per head and token (K = head_dim, V = value head dim), WY/UT form over chunks of C tokens: K K^T
        2CK, the unit-triangular solve C^2, Q K^T 2CK, the dense in-chunk block (levels 0..6) E = (Q K^T) X 2C^2
        and its lambda-masked product with V 2CV, W = X K 2CK, q_eff = (Q K^T) W 2CK, the chunk transition
        M = e^gamma I - Kd^T W 2K^2, Kd^T X 2CK and the chunk's own write (Kd^T X) V 2KV; then J =
        max(0, bit_length(seq_len - 1) - 6) = ceil(log2(seq_len / C)) chunk-level passes (levels 7..), each
        reading its K x V state 2KV and carrying it through M (2K^2 V per chunk, 2K^2 V / C per token):
        10CK + 3C^2 + 2CV + 2K^2 + 2KV + J (2KV + 2K^2 V / C). Elementwise work is not counted. The backward is
        counted as twice the forward (3x in all).
        """
        c = min(64, seq_len)
        dk, dv = self.head_dim, self.head_v_dim
        passes = max(0, (seq_len - 1).bit_length() - 6)
        forward = 10 * c * dk + 3 * c * c + 2 * c * dv + 2 * dk * dk + 2 * dk * dv + passes * (
            2 * dk * dv + 2 * dk * dk * dv / c)
        conv = self.q_conv.flops_per_token() + self.k_conv.flops_per_token() + self.v_conv.flops_per_token()
        return float(3 * self.num_heads * forward + conv)
