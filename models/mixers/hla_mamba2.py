"""Mamba-2 shell with a decayed HLA operator (mamba2 with config.operator hla2, ahla or hla3; docs/kernels.md)."""

from typing import ClassVar

from models.mixers.mamba2 import Mamba2Mixer
from models.ops import (
    OPERATORS,
    l2_normalize,
    operator_pass_flops,
    read_operator_state,
    run_operator,
    write_operator_state,
)
from models.registry import register_mixer


@register_mixer("hla_mamba2")
class HLAMamba2Mixer(Mamba2Mixer):
    """Mamba-2 whose SSD scan is a higher-order operator: the shell of Mamba2Mixer (same parameters: in_proj ->
    [z | x, B, C | dt], conv + SiLU on [x, B, C], dt = softplus(dt + dt_bias), A = -exp(A_log), D skip,
    RMSNorm(y * SiLU(z)), out_proj) with, per head, the SSM decay as the operator's decay:

        y = operator(q = C / |C|, k = B / |B|, v = x * dt, g = A * dt, scale = 1) + D x

    (hilo_kernels.hla2 / ahla / hla3, docs/kernels.md; with b_t = prod_{r <= t} exp(g_r), hla2 "d1" is
    y_t = sum_{i <= j <= t} (b_t/b_i)(b_j/b_i) (q_t.k_i)(k_i.q_j) v_j + D x_t).

    B and C are L2-normalised per head (over the state_size N), as the HLA layer normalises q and k:
    the second-order sums multiply two scores q.k, so unnormalised B and C would let the output grow with their
    squared norms as well as with the number of tokens the decay keeps; with unit B and C every score lies in
    [-1, 1] and scale 1 (the HLA family's) needs no tuning with N. The decay keeps the sums bounded: g <= 0 is
    Mamba-2's own A * dt.

    Options: Mamba2Mixer's, plus
      decay_convention  where hla2's decay sits: "d1" (default; the mask on A = q k^T, weight (b_t/b_i)(b_j/b_i))
                        or "d2" ("decay every summary", (b_t/b_i)(b_t/b_j)); ahla and hla3 have "d1" only.
    backend is the operator's: None (triton on CUDA, torch otherwise), "triton", "torch", "naive".

    Cache slot: "conv_state" as Mamba2Mixer, and the operator's state field by field (hilo_kernels.hla.state, fp32,
    batch rows first: "S" [B, H, N, N] and "F" [B, H, N, P] for hla2; "P", "E" [B, H, N, P] for ahla; "S", "P", "F"
    for hla3). A single new token takes the recurrent step hilo_kernels.hla.hla_step; packed documents (cu_seqlens)
    restart the conv and the state at every boundary.
    """

    GROUPED_OPERATOR: ClassVar[bool] = False  # the operator takes B and C per head

    NAME: ClassVar[str] = "hla_mamba2"
    DEFAULTS: ClassVar[dict] = {**Mamba2Mixer.DEFAULTS, "decay_convention": "d1"}

    def __init__(self, config, layer_idx: int):
        if config.operator not in OPERATORS:
            raise ValueError(f"the hla_mamba2 mixer runs operator {sorted(OPERATORS)} in the Mamba-2 shell; set "
                             f"mixer=mamba2 and operator=hla2|ahla|hla3, got operator={config.operator!r}")
        super().__init__(config, layer_idx)
        self.operator = config.operator
        self.decay_convention = config.mixer_kwargs.get("decay_convention", self.DEFAULTS["decay_convention"])
        if self.decay_convention not in ("d1", "d2") or (self.decay_convention == "d2" and self.operator != "hla2"):
            raise ValueError(f"hla_mamba2: decay_convention must be 'd1', or 'd2' for operator hla2; got "
                             f"{self.decay_convention!r} for operator {self.operator!r}")

    def _group_inputs(self, bm, cm):
        """B and C [B, T, G, N] L2-normalised over N, once per group (the heads of a group share them): the
        normalisation then keeps its input for the backward per group, not per head."""
        return l2_normalize(bm), l2_normalize(cm)

    def _mix(self, cm, bm, v, g, dl, cache, cu_seqlens):
        """The operator over (q = C, k = B) L2-normalised (by _group_inputs), v = x * dt, g = A * dt ([B, T, H, P]);
        with a cache it continues the slot's operator state and stores the new one."""
        slot = cache[self.layer_idx] if cache is not None else None
        y, state = run_operator(self.operator, cm, bm, v, g,
                                read_operator_state(self.operator, slot), slot is not None, cu_seqlens,
                                decay=self.decay_convention, backend=self.backend)
        if slot is not None:
            write_operator_state(slot, state)
        return y

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the operator's chunked linear_attn passes (chunk C = min(64, seq_len)) and
        the conv (projections count as 6 x their params in the model's total): per head, with K = state_size and
        V = head_dim, models.ops.operator_pass_flops forward, the backward counted as twice that (3x)."""
        forward = operator_pass_flops(self.operator, min(64, seq_len), self.state_size, self.head_dim)
        return float(3 * self.num_heads * forward + self.conv.flops_per_token())
