"""Mamba-2 mixer (the mamba2 shell, operator hilo_kernels.linear_attn: the SSD recurrence; docs/kernels.md)."""

from typing import ClassVar

import torch
from torch import nn

from hilo_kernels.linear_attn import linear_attn, linear_attn_step
from models.conv import ShortConv
from models.gates import a_log_init, dt_bias_init, log_decay, no_weight_decay
from models.norms import GatedRMSNorm
from models.registry import mixer_options, register_mixer


@register_mixer("mamba2")
class Mamba2Mixer(nn.Module):
    """Mamba-2: in_proj -> [z | x, B, C | dt]; causal depthwise conv (conv_size) + SiLU on [x, B, C];
    dt = softplus(dt + dt_bias), A = -exp(A_log); per head h with x_h [P], B, C [N] of the head's group:

        S_t = exp(A dt_t) S_{t-1} + B_t (dt_t x_t)^T,   y_t = C_t^T S_t + D x_t

    i.e. linear_attn(q=C, k=B, v=x*dt, g=A*dt, scale=1) (S is N x P); then RMSNorm(y * SiLU(z)) (per group of
    channels when n_groups > 1) and out_proj.

    Options (config.mixer_kwargs, all optional):
      head_dim    P, channels per head (64); num_heads = expand * hidden_size / head_dim. config.num_heads and
                  config.head_dim are the attention layers' (hybrids) and are not used here.
      state_size  N (128).
      expand      inner width = expand * hidden_size (2).
      n_groups    B and C are shared by the num_heads / n_groups heads of a group (1).
      conv_size   short conv kernel size (4); conv_bias: whether the conv has a bias (True).
      a_init_range, dt_min, dt_max   init: exp(A_log) ~ U[1, 16]; softplus(dt_bias) log-uniform in [1e-3, 1e-1].
      backend     the linear_attn backend: None (triton on CUDA, torch otherwise), "triton", "torch", "naive".

    forward(hidden [B, T, C], position_ids, cu_seqlens [N+1] or None, cache HiloCache or None) -> [B, T, C].
    The cache slot holds "conv_state" ([B, d_inner + 2 * n_groups * N, conv_size - 1]) and "recurrent_state"
    ([B, H, N, P] fp32). Packed documents (cu_seqlens, B == 1) restart the conv and the state at every boundary.
    """

    NAME: ClassVar[str] = "mamba2"
    DEFAULTS: ClassVar[dict] = {"head_dim": 64, "state_size": 128, "expand": 2, "n_groups": 1, "conv_size": 4,
                                "conv_bias": True, "a_init_range": (1.0, 16.0), "dt_min": 1e-3, "dt_max": 1e-1,
                                "backend": None}

    def __init__(self, config, layer_idx: int, num_levels: int = 0):
        """num_levels > 0 appends a per-token level projection dl (num_heads * num_levels outputs) to in_proj,
        which forward hands to _mix (the log-linear subclass's lambda); the plain mixer has none."""
        super().__init__()
        opts = mixer_options(self.NAME, config.mixer_kwargs, self.DEFAULTS)
        self.layer_idx = layer_idx
        c = config.hidden_size
        self.head_dim = int(opts["head_dim"])
        self.state_size = int(opts["state_size"])
        self.n_groups = int(opts["n_groups"])
        self.d_inner = int(opts["expand"] * c)
        if min(self.head_dim, self.state_size, self.n_groups, self.d_inner) < 1:
            raise ValueError(f"mamba2 needs positive head_dim, state_size, n_groups and expand, got {opts}")
        if self.d_inner % self.head_dim != 0:
            raise ValueError(f"mamba2: expand * hidden_size ({self.d_inner}) must be a multiple of head_dim "
                             f"({self.head_dim})")
        self.num_heads = self.d_inner // self.head_dim
        if self.num_heads % self.n_groups != 0:
            raise ValueError(f"mamba2: num_heads ({self.num_heads} = expand * hidden_size / head_dim) must be a "
                             f"multiple of n_groups ({self.n_groups})")
        self.backend = opts["backend"]
        h, gn = self.num_heads, self.n_groups * self.state_size
        self.conv_dim = self.d_inner + 2 * gn
        self.in_proj_sizes = [self.d_inner, self.conv_dim, h, h * num_levels]
        self.in_proj = nn.Linear(c, sum(self.in_proj_sizes), bias=False)
        self.conv = ShortConv(self.conv_dim, opts["conv_size"], bias=bool(opts["conv_bias"]))
        a_min, a_max = opts["a_init_range"]
        self.A_log = a_log_init(h, a_min, a_max)
        self.dt_bias = dt_bias_init(h, opts["dt_min"], opts["dt_max"])
        self.D = no_weight_decay(nn.Parameter(torch.ones(h)))
        self.norm = GatedRMSNorm(self.d_inner, config.norm_eps, norm_before_gate=False,
                                 group_size=self.d_inner // self.n_groups)
        self.out_proj = nn.Linear(self.d_inner, c, bias=False)
        self.out_proj._is_residual_proj = True

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        cache=None,
    ) -> torch.Tensor:
        b, t, _ = hidden.shape
        h, p, gn = self.num_heads, self.head_dim, self.n_groups * self.state_size
        slot = cache[self.layer_idx] if cache is not None else None
        z, xbc, dt, dl = self.in_proj(hidden).split(self.in_proj_sizes, dim=-1)
        xbc, conv_state = self.conv(xbc, slot.get("conv_state") if slot else None, cu_seqlens)
        x, bm, cm = xbc.split([self.d_inner, gn, gn], dim=-1)
        x = x.reshape(b, t, h, p)
        decode = slot is not None and t == 1 and cu_seqlens is None
        bm, cm = self._group_inputs(bm.unflatten(-1, (self.n_groups, self.state_size)),
                                    cm.unflatten(-1, (self.n_groups, self.state_size)))
        if decode or not self.GROUPED_OPERATOR:
            bm, cm = self._per_head(bm, decode), self._per_head(cm, decode)
        dt, g = log_decay(self.A_log, dt, self.dt_bias)
        v = (x * dt.unsqueeze(-1)).to(x.dtype)  # fp32 product (dt is fp32) without keeping an fp32 copy of x
        y = self._mix(cm, bm, v, g, dl, cache, cu_seqlens)
        if slot is not None:
            slot["conv_state"] = conv_state
        y = y + x * self.D.unsqueeze(-1).to(x.dtype)
        y = self.norm(y.reshape(b, t, self.d_inner), z)
        return self.out_proj(y)

    # Whether _mix's scan takes B and C per group ([B, T, G, N]; linear_attn repeats them to the heads itself and
    # keeps only the G-head tensors for the backward: 2 * (H - G) * N fewer values per token and layer). Operators
    # without grouped inputs (the log-linear and HLA subclasses) get them repeated to every head.
    GROUPED_OPERATOR: ClassVar[bool] = True

    def _group_inputs(self, bm: torch.Tensor, cm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """B and C [B, T, G, N] as the operator takes them, per group, before they are repeated to every head of
        their group (so what a subclass computes here runs, and is kept for the backward, once per group rather
        than once per head). Mamba-2 takes them as they are."""
        return bm, cm

    def _per_head(self, m: torch.Tensor, decode: bool) -> torch.Tensor:
        """B or C [B, T, G, N] -> [B, T, H, N], each group's for its H / G heads. A decoding step broadcasts instead
        of copying (a stride-0 view when G == 1): its recurrent step takes any strides, while the scan kernels
        get contiguous inputs."""
        b, t, g, n = m.shape
        if decode:
            return m.unsqueeze(3).expand(b, t, g, self.num_heads // g, n).reshape(b, t, self.num_heads, n)
        return m.repeat_interleave(self.num_heads // g, dim=2)

    def _mix(self, cm, bm, v, g, dl, cache, cu_seqlens):
        """The scan y = linear_attn(q=C, k=B, v, g, scale=1) ([B, T, H, P]; C and B per head for a decoding step,
        per group otherwise); with a cache it continues the slot's
        "recurrent_state" and stores the new one (a single token takes the recurrent step). dl is the in_proj's
        level projection ([B, T, 0] here)."""
        b, t, h, p = v.shape
        slot = cache[self.layer_idx] if cache is not None else None
        state = slot.get("recurrent_state") if slot is not None else None
        if slot is not None and t == 1 and cu_seqlens is None:
            if state is None:
                state = v.new_zeros(b, h, self.state_size, p, dtype=torch.float32)
            y, state = linear_attn_step(cm[:, 0], bm[:, 0], v[:, 0], g=g[:, 0], state=state, scale=1.0)
            y = y.unsqueeze(1)
        else:
            y, state = linear_attn(cm, bm, v, g=g, scale=1.0, initial_state=state, output_final_state=slot is not None,
                                   cu_seqlens=cu_seqlens, backend=self.backend)
        if slot is not None:
            slot["recurrent_state"] = state
        return y

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the chunked SSD scan (chunk C = min(64, seq_len)) and the conv (the
        projections count as 6 x their params in the model's total).

        Forward, per head and token, with K = state_size and V = head_dim: the intra-chunk C^T B scores 2CK and
        their product with the values 2CV (the whole C x C block is computed), the inter-chunk read C^T S 2KV and
        the state update B^T V 2KV: 2C(K + V) + 4KV. The backward is counted as twice the forward (3x in all).
        """
        c = min(64, seq_len)
        k, v = self.state_size, self.head_dim
        return float(3 * self.num_heads * (2 * c * (k + v) + 4 * k * v) + self.conv.flops_per_token())
