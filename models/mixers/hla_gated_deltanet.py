"""Gated DeltaNet shell with a decayed HLA operator (gated_deltanet with config.operator hla2, ahla or
hla3; docs/kernels.md)."""

from typing import ClassVar

import torch

from hilo_kernels.common.validate import MAX_HEAD_DIM
from models.mixers.gated_deltanet import GatedDeltaNetMixer
from models.ops import (
    OPERATORS,
    operator_pass_flops,
    read_operator_state,
    run_operator,
    value_blocks,
    write_operator_state,
)
from models.registry import register_mixer

# The K x K key moment of hla2 / hla3: it does not depend on the values, so every value block carries it whole.
KEY_FIELD = "S"


def value_block(state, lo: int, hi: int):
    """The part of an HLA state that value columns lo:hi use (the key moment whole, the value fields sliced)."""
    return type(state)(*(x if name == KEY_FIELD else x[..., lo:hi] for name, x in zip(state._fields, state)))


def join_value_blocks(states: list):
    """The inverse of value_block over consecutive column blocks (their key moments are equal: take the first)."""
    return type(states[0])(*(xs[0] if name == KEY_FIELD else torch.cat(xs, -1)
                             for name, *xs in zip(states[0]._fields, *states)))


@register_mixer("hla_gated_deltanet")
class HLAGatedDeltaNetMixer(GatedDeltaNetMixer):
    """Gated DeltaNet whose delta rule is a higher-order operator: the shell of GatedDeltaNetMixer (q, k, v
    projections with short convs + SiLU, q and k L2-normalised per head, g = -exp(A_log) * softplus(a_proj x +
    dt_bias), per-head RMSNorm gated by SiLU(g_proj x), o_proj) with the gate as the operator's decay:

        o = operator(q, k, v, g, scale = 1)

    (hilo_kernels.hla2 / ahla / hla3, docs/kernels.md; ahla is o_t = sum_{j <= i <= t} (b_t/b_j) (q_t.k_i)(q_i.k_j) v_j with
    b_t = prod_{r <= t} exp(g_r)). Scale 1 as for the HLA family: q and k are unit vectors already. The HLA
    operators have no write strength, so there is no beta and no b_proj (a projection nothing reads would never
    train).

    Options: GatedDeltaNetMixer's, plus decay_convention ("d1" default, the mask on A = q k^T; "d2" for hla2
    only, "decay every summary"). backend is the operator's. Value heads wider than 256 columns (the default
    expand_v 2 with head_dim 256) run in blocks of at most 256 columns: exact, since every pass is linear in its
    values column by column; hla2 and hla3 recompute their key pass LA(Q, K, K) per block, ahla recomputes
    nothing.

    Cache slot: "conv_q", "conv_k", "conv_v" as GatedDeltaNetMixer, and the operator's state field by field
    (hilo_kernels.hla.state, fp32: "S" [B, H, K, K] and "F" [B, H, K, V] for hla2; "P", "E" [B, H, K, V] for ahla;
    "S", "P", "F" for hla3). A single new token takes the recurrent step hilo_kernels.hla.hla_step.
    """

    NAME: ClassVar[str] = "hla_gated_deltanet"
    DEFAULTS: ClassVar[dict] = {**GatedDeltaNetMixer.DEFAULTS, "decay_convention": "d1"}
    USES_BETA: ClassVar[bool] = False
    MAX_VALUE_BLOCK: ClassVar[int] = MAX_HEAD_DIM  # the HLA operators take V <= 256

    def __init__(self, config, layer_idx: int):
        if config.operator not in OPERATORS:
            raise ValueError(f"the hla_gated_deltanet mixer runs operator {sorted(OPERATORS)} in the Gated DeltaNet "
                             f"shell; set mixer=gated_deltanet and operator=hla2|ahla|hla3, got "
                             f"operator={config.operator!r}")
        super().__init__(config, layer_idx)
        self.operator = config.operator
        self.decay_convention = config.mixer_kwargs.get("decay_convention", self.DEFAULTS["decay_convention"])
        if self.decay_convention not in ("d1", "d2") or (self.decay_convention == "d2" and self.operator != "hla2"):
            raise ValueError(f"hla_gated_deltanet: decay_convention must be 'd1', or 'd2' for operator hla2; got "
                             f"{self.decay_convention!r} for operator {self.operator!r}")

    def _mix(self, q, k, v, beta, g, x, cache, cu_seqlens):
        """The operator over value blocks of at most 256 columns ([B, T, H, V]; a single decoding token takes the
        recurrent step over all columns at once); with a cache it continues the slot's operator state and stores
        the new one. beta is None (no write strength) and x unused."""
        slot = cache[self.layer_idx] if cache is not None else None
        state = read_operator_state(self.operator, slot)
        if slot is not None and q.shape[1] == 1 and cu_seqlens is None:
            # the recurrent step has no head-dim limit: one call over all value columns, which also updates the
            # key moment once instead of once per block
            o, state = run_operator(self.operator, q, k, v, g, state, True, None, decay=self.decay_convention)
            write_operator_state(slot, state)
            return o
        outs, finals = [], []
        for lo, hi in value_blocks(self.head_v_dim, self.value_block):
            o, final = run_operator(self.operator, q, k, v[..., lo:hi], g,
                                    None if state is None else value_block(state, lo, hi), slot is not None,
                                    cu_seqlens, decay=self.decay_convention, backend=self.backend)
            outs.append(o)
            finals.append(final)
        if slot is not None:
            write_operator_state(slot, join_value_blocks(finals))
        return outs[0] if len(outs) == 1 else torch.cat(outs, -1)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the operator's chunked linear_attn passes (chunk C = min(64, seq_len)),
        block by block of value columns (models.ops.operator_pass_flops with K = head_dim and W the block's
        width: the key pass of hla2 / hla3 counts once per block, as it runs), and the three convs (projections
        count as 6 x their params in the model's total). The backward is counted as twice the forward (3x)."""
        c = min(64, seq_len)
        forward = sum(operator_pass_flops(self.operator, c, self.head_dim, hi - lo)
                      for lo, hi in value_blocks(self.head_v_dim, self.value_block))
        conv = self.q_conv.flops_per_token() + self.k_conv.flops_per_token() + self.v_conv.flops_per_token()
        return float(3 * self.num_heads * forward + conv)
