"""Gated DeltaNet mixer (the gated_deltanet shell, operator hilo_kernels.delta_rule; docs/kernels.md)."""

import math
from typing import ClassVar

import torch
from torch import nn

from hilo_kernels.common.validate import MAX_DELTA_VALUE_DIM, MAX_HEAD_DIM
from hilo_kernels.delta_rule import delta_rule, delta_rule_step
from models.casts import ProjectionInput
from models.conv import ShortConv
from models.gates import a_log_init, dt_bias_init, log_decay
from models.norms import GatedRMSNorm
from models.ops import l2_normalize, value_blocks
from models.registry import mixer_options, register_mixer


def default_num_heads(hidden_size: int, head_dim: int) -> int:
    """round(0.75 * hidden_size / head_dim), at least 1: 6 heads of 256 at hidden 2048, as in the Gated DeltaNet paper."""
    return max(1, math.floor(0.75 * hidden_size / head_dim + 0.5))


@register_mixer("gated_deltanet")
class GatedDeltaNetMixer(nn.Module):
    """Gated DeltaNet: q, k, v projections, each through a causal depthwise conv (conv_size, SiLU); q and k
    L2-normalised per head; beta = sigmoid(b_proj x); g = -exp(A_log) * softplus(a_proj x + dt_bias) (fp32 log
    decay); o = delta_rule(q, k, v, beta=beta, g=g) with scale head_dim ** -0.5; per-head RMSNorm(o) * SiLU(g_proj x);
    o_proj.

    Options (config.mixer_kwargs, all optional):
      head_dim   q/k head dim K (256).
      num_heads  None: round(0.75 * hidden_size / head_dim), at least 1 (6 at hidden 2048). config.num_heads
                 and config.head_dim are the attention layers' (hybrids) and are not used here.
      expand_v   value head dim V = expand_v * head_dim (2).
      conv_size  short conv kernel size (4).
      value_block  value columns per operator call (None: the operator's widest, 512 for the delta rule, 256 for
                   the HLA operators).
      a_init_range, dt_min, dt_max   init: exp(A_log) ~ U[1, 16]; softplus(dt_bias) log-uniform in [1e-3, 1e-1].
      backend    the delta_rule backend: None (triton on CUDA, torch otherwise), "triton", "torch", "naive".

    forward(hidden [B, T, C], position_ids, cu_seqlens [N+1] or None, cache HiloCache or None) -> [B, T, C].
    The cache slot holds "conv_q", "conv_k", "conv_v" ([B, channels, conv_size - 1], the last inputs of each
    conv) and "recurrent_state" ([B, H, K, V] fp32). Packed documents (cu_seqlens, B == 1) restart the convs and
    the state at every boundary.
    """

    NAME: ClassVar[str] = "gated_deltanet"
    # Whether the operator takes the delta rule's write strength beta (then b_proj exists); operators without it
    # (the HLA family) leave it out, so no parameter goes untrained.
    USES_BETA: ClassVar[bool] = True
    # The widest value block the operator takes in one call (hilo_kernels.common.validate: 512 for the delta rules, 256 for
    # the HLA operators), and the default of mixer_kwargs.value_block (None). Wider heads run in blocks of value_block
    # columns, exact either way: each column of the K x V state evolves on its own (see _operator). One 512-column
    # call does the K-only WY work once: delta_rule fwd+bwd at H = 3, K = 256, 16K x 2 on the H200 takes 6.71 ms
    # against 2 x 4.00, and compiled GDN 340m at 8K trains at 103,659 tokens/s against 90,091 (docs/performance.md;
    # its bf16 GPU tests pass, and the 10-step losses that once made it suspect differ as much between equally
    # exact short conv tilings). Log-linear GDN 340m at 2 x 16K, compiled: 11,582 tokens/s and
    # 83.2 GiB against 10,780 and 104.7 GiB.
    MAX_VALUE_BLOCK: ClassVar[int] = MAX_DELTA_VALUE_DIM
    DEFAULTS: ClassVar[dict] = {"head_dim": 256, "num_heads": None, "expand_v": 2, "conv_size": 4,
                                "a_init_range": (1.0, 16.0), "dt_min": 1e-3, "dt_max": 1e-1, "backend": None,
                                "value_block": None}

    def __init__(self, config, layer_idx: int):
        super().__init__()
        opts = mixer_options(self.NAME, config.mixer_kwargs, self.DEFAULTS)
        self.layer_idx = layer_idx
        c = config.hidden_size
        self.head_dim = int(opts["head_dim"])
        self.num_heads = int(opts["num_heads"] or default_num_heads(c, self.head_dim))
        self.head_v_dim = int(opts["expand_v"] * self.head_dim)
        if self.head_dim < 1 or self.num_heads < 1 or self.head_v_dim < 1:
            raise ValueError(f"gated_deltanet needs positive head_dim, num_heads and expand_v * head_dim, got "
                             f"{self.head_dim}, {self.num_heads}, {self.head_v_dim}")
        if self.head_dim > MAX_HEAD_DIM:
            raise ValueError(f"gated_deltanet head_dim must be <= {MAX_HEAD_DIM} (the kernels' limit), got "
                             f"{self.head_dim}")
        given = opts["value_block"]
        self.value_block = self.MAX_VALUE_BLOCK if given is None else int(given)
        if not 1 <= self.value_block <= self.MAX_VALUE_BLOCK:
            raise ValueError(f"{self.NAME} value_block must be in 1..{self.MAX_VALUE_BLOCK} (the operator's widest value "
                             f"head per call), got {opts['value_block']}")
        self.backend = opts["backend"]
        h, dk, dv = self.num_heads, self.head_dim, self.head_v_dim
        self.q_proj = nn.Linear(c, h * dk, bias=False)
        self.k_proj = nn.Linear(c, h * dk, bias=False)
        self.v_proj = nn.Linear(c, h * dv, bias=False)
        self.a_proj = nn.Linear(c, h, bias=False)
        if self.USES_BETA:
            self.b_proj = nn.Linear(c, h, bias=False)
        self.g_proj = nn.Linear(c, h * dv, bias=False)
        self.q_conv = ShortConv(h * dk, opts["conv_size"])
        self.k_conv = ShortConv(h * dk, opts["conv_size"])
        self.v_conv = ShortConv(h * dv, opts["conv_size"])
        a_min, a_max = opts["a_init_range"]
        self.A_log = a_log_init(h, a_min, a_max)
        self.dt_bias = dt_bias_init(h, opts["dt_min"], opts["dt_max"])
        self.norm = GatedRMSNorm(dv, config.norm_eps, norm_before_gate=True)
        self.o_proj = nn.Linear(h * dv, c, bias=False)
        self.o_proj._is_residual_proj = True
        self.fused_projections = getattr(config, "fused_projections", False)

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        cache=None,
    ) -> torch.Tensor:
        b, t, _ = hidden.shape
        h, dk, dv = self.num_heads, self.head_dim, self.head_v_dim
        slot = cache[self.layer_idx] if cache is not None else None
        x = ProjectionInput(hidden)  # one autocast copy of hidden saved for all the projections, not one each
        projs = [self.q_proj, self.k_proj, self.v_proj, self.g_proj, self.a_proj]
        q, k, v, gate, a, *b_in = x.project(projs + ([self.b_proj] if self.USES_BETA else []), self.fused_projections)
        q, conv_q = self.q_conv(q, slot.get("conv_q") if slot else None, cu_seqlens)
        k, conv_k = self.k_conv(k, slot.get("conv_k") if slot else None, cu_seqlens)
        v, conv_v = self.v_conv(v, slot.get("conv_v") if slot else None, cu_seqlens)
        q = l2_normalize(q.view(b, t, h, dk))
        k = l2_normalize(k.view(b, t, h, dk))
        v = v.view(b, t, h, dv)
        beta = torch.sigmoid(b_in[0].float()) if self.USES_BETA else None
        _, g = log_decay(self.A_log, a, self.dt_bias)
        o = self._mix(q, k, v, beta, g, x, cache, cu_seqlens)
        if slot is not None:
            slot.update(conv_q=conv_q, conv_k=conv_k, conv_v=conv_v)
        o = self.norm(o, gate.view(b, t, h, dv))
        return self.o_proj(o.reshape(b, t, h * dv))

    def _mix(self, q, k, v, beta, g, x, cache, cu_seqlens):
        """The operator ([B, T, H, V]); with a cache it continues the slot's "recurrent_state" and stores the new
        one. x (the layer input as a models.casts.ProjectionInput: x() is what to pass to a projection) is unused
        here: subclasses derive extra per-token operator inputs from it."""
        slot = cache[self.layer_idx] if cache is not None else None
        state = slot.get("recurrent_state") if slot is not None else None
        o, state = self._operator(q, k, v, beta, g, state, slot is not None, cu_seqlens)
        if slot is not None:
            slot["recurrent_state"] = state
        return o

    def _operator(self, q, k, v, beta, g, state, output_final_state, cu_seqlens):
        """delta_rule over value blocks of at most value_block columns (exact whatever the width: the
        update S <- exp(g) (I - beta k k^T) S + beta k v^T acts on each column of S independently).

        A single decoding token (T == 1, no cu_seqlens, a state to continue) takes the recurrent step, in one call
        over all columns: the step is plain PyTorch with no head-dim limit, and slicing the state into blocks and
        joining them again would cost a pass over the state and twice the launches.
        """
        b, t = q.shape[:2]
        if state is None and t == 1 and output_final_state and cu_seqlens is None:
            state = q.new_zeros(b, self.num_heads, self.head_dim, self.head_v_dim, dtype=torch.float32)
        if t == 1 and state is not None and cu_seqlens is None:
            o, final = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta=beta[:, 0], g=g[:, 0], state=state)
            return o.unsqueeze(1), final if output_final_state else None
        outs, finals = [], []
        for lo, hi in value_blocks(self.head_v_dim, self.value_block):
            o, s1 = delta_rule(q, k, v[..., lo:hi], beta=beta, g=g,
                               initial_state=None if state is None else state[..., lo:hi],
                               output_final_state=output_final_state, cu_seqlens=cu_seqlens, backend=self.backend)
            outs.append(o)
            finals.append(s1)
        o = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
        final = None
        if output_final_state:
            final = finals[0] if len(finals) == 1 else torch.cat(finals, -1)
        return o, final

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the chunked delta rule (chunk C = min(64, seq_len)) and the three convs
        (projections count as 6 x their params in the model's total).

        Forward, per head and token, with the WY/UT representation over chunks of C tokens: K K^T 2CK, the unit
        triangular solve C^2 (C^3 per chunk, counted as the two solves of W and U), W = T(beta K) 2CK,
        U = T(beta V) 2CV, U - W S 2KV, Q S 2KV, Q K^T 2CK, (Q K^T) U 2CV, state update K^T U 2KV: together
        6CK + 4CV + 6KV + C^2. The backward is counted as twice the forward (3x in all).
        """
        c = min(64, seq_len)
        dk, dv = self.head_dim, self.head_v_dim
        forward = 6 * c * dk + 4 * c * dv + 6 * dk * dv + c * c
        conv = self.q_conv.flops_per_token() + self.k_conv.flops_per_token() + self.v_conv.flops_per_token()
        return float(3 * self.num_heads * forward + conv)
