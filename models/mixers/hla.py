"""Higher-order linear attention mixer: the transformer shell with operator hla2, ahla or hla3 (docs/kernels.md)."""

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from models.casts import ProjectionInput
from models.conv import ShortConv
from models.gates import a_log_init, dt_bias_init, log_decay
from models.norms import GatedRMSNorm
from models.ops import (
    OPERATORS,
    PASS_CHUNK,
    l2_normalize,
    operator_pass_flops,
    read_operator_state,
    run_operator,
    write_operator_state,
)
from models.registry import mixer_options, register_mixer
from models.rope import rope_tables, rotate


@register_mixer("hla")
class HLAMixer(nn.Module):
    """HLA as a drop-in for softmax attention (config.mixer "attention" with config.operator hla2, ahla or hla3).

    q = q_proj x, k = k_proj x, v = v_proj x (num_heads query heads, num_kv_heads key/value heads of head_dim,
    shared by num_heads / num_kv_heads query heads as in GQA), each optionally through a causal depthwise short
    conv (SiLU); RoPE (theta = config.rope_theta) on q and k; with normalize, the feature map elu + 1 on q and k
    (after RoPE, so they stay non-negative); q and k L2-normalised per head; optionally a per-head
    data-dependent log decay g = -exp(A_log) * softplus(a_proj x + dt_bias) (fp32, as in the recurrent shells);
    o = operator(q, k, v, g=g) with scale 1.0 (hilo_kernels.hla2 / ahla / hla3: the masked operators of docs/kernels.md);
    per-head RMSNorm(o) * SiLU(g_proj x); o_proj.

    Options (config.mixer_kwargs, all optional):
      decay             per-head data-dependent decay (False: the undecayed operator).
      decay_convention  hla2's decay placement: "d1" (the mask on A = q k^T) or "d2" ("decay every summary");
                        ahla and hla3 have "d1" only. Only meaningful with decay: True.
      normalize         divide by the operator applied to a value of ones (signed clamp), with elu + 1 features.
      conv_size         None: no short conv; an int: the kernel size of the short convs on q, k and v.
      a_init_range, dt_min, dt_max   decay init: exp(A_log) ~ U[1, 16]; softplus(dt_bias) log-uniform in
                        [1e-3, 1e-1].
      backend           the operator's backend: None (hilo_kernels.hla.default_backend: on CUDA the composition for
                        hla3 and for bf16 hla2, the fused kernels otherwise; torch elsewhere), "triton" (the
                        composition of linear_attn kernels: bf16 passes for bf16 hla2 / hla3, fp32 ones
                        otherwise), "fused" (one-pass Triton hla2/ahla), "torch", "naive".

    forward(hidden [B, T, C], position_ids [B, T], cu_seqlens [N+1] or None, cache HiloCache or None) -> [B, T, C].
    The cache slot holds the operator's recurrent state field by field (hilo_kernels.hla.state: "S", "F" for hla2;
    "P", "E" for ahla; "S", "P", "F" for hla3; fp32, batch rows first) and, with short convs, "conv_q", "conv_k",
    "conv_v" ([B, channels, conv_size - 1]). A single new token with a cache takes the operator's recurrent step
    (hilo_kernels.hla.step); longer inputs continue the state through the chunked operator. Packed documents
    (cu_seqlens, B == 1) restart the convs and the state at every boundary; positions restart with them.
    """

    NAME: ClassVar[str] = "hla"
    DEFAULTS: ClassVar[dict] = {"decay": False, "decay_convention": "d1", "normalize": False, "conv_size": None,
                                "a_init_range": (1.0, 16.0), "dt_min": 1e-3, "dt_max": 1e-1, "backend": None}

    def __init__(self, config, layer_idx: int):
        super().__init__()
        if config.operator not in OPERATORS:
            raise ValueError(f"the hla mixer runs operator {sorted(OPERATORS)} in the transformer shell; set "
                             f"mixer=attention and operator=hla2|ahla|hla3, got operator={config.operator!r}")
        opts = mixer_options(self.NAME, config.mixer_kwargs, self.DEFAULTS)
        self.layer_idx = layer_idx
        self.operator = config.operator
        self.decay = bool(opts["decay"])
        self.decay_convention = opts["decay_convention"]
        if self.decay_convention not in ("d1", "d2"):
            raise ValueError(f"hla mixer: decay_convention must be 'd1' or 'd2', got {self.decay_convention!r}")
        if self.decay_convention == "d2" and not (self.decay and self.operator == "hla2"):
            raise ValueError(f"hla mixer: decay_convention 'd2' exists for operator hla2 with decay: true only, got "
                             f"operator {self.operator!r} with decay: {self.decay}")
        self.normalize = bool(opts["normalize"])
        self.backend = opts["backend"]
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        c, h, hkv, d = config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(c, h * d, bias=False)
        self.k_proj = nn.Linear(c, hkv * d, bias=False)
        self.v_proj = nn.Linear(c, hkv * d, bias=False)
        self.g_proj = nn.Linear(c, h * d, bias=False)
        self.conv_size = opts["conv_size"]
        if self.conv_size is not None:
            self.q_conv = ShortConv(h * d, int(self.conv_size))
            self.k_conv = ShortConv(hkv * d, int(self.conv_size))
            self.v_conv = ShortConv(hkv * d, int(self.conv_size))
        if self.decay:
            a_min, a_max = opts["a_init_range"]
            self.a_proj = nn.Linear(c, h, bias=False)
            self.A_log = a_log_init(h, a_min, a_max)
            self.dt_bias = dt_bias_init(h, opts["dt_min"], opts["dt_max"])
        self.norm = GatedRMSNorm(d, config.norm_eps, norm_before_gate=True)
        self.o_proj = nn.Linear(h * d, c, bias=False)
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
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        slot = cache[self.layer_idx] if cache is not None else None
        x = ProjectionInput(hidden)  # one autocast copy of hidden saved for all the projections, not one each
        projs = [self.q_proj, self.k_proj, self.v_proj, self.g_proj] + ([self.a_proj] if self.decay else [])
        q, k, v, gate, *a = x.project(projs, self.fused_projections)
        if self.conv_size is not None:
            q, conv_q = self.q_conv(q, slot.get("conv_q") if slot is not None else None, cu_seqlens)
            k, conv_k = self.k_conv(k, slot.get("conv_k") if slot is not None else None, cu_seqlens)
            v, conv_v = self.v_conv(v, slot.get("conv_v") if slot is not None else None, cu_seqlens)
            if slot is not None:
                slot.update(conv_q=conv_q, conv_k=conv_k, conv_v=conv_v)
        q, k, v = q.view(b, t, h, d), k.view(b, t, hkv, d), v.view(b, t, hkv, d)
        tables = rope_tables(position_ids, d, self.rope_theta)
        q, k = rotate(q, tables), rotate(k, tables)
        if self.normalize:
            q, k = F.elu(q) + 1, F.elu(k) + 1
        q, k = l2_normalize(q), l2_normalize(k)
        if hkv != h:
            k, v = k.repeat_interleave(h // hkv, dim=2), v.repeat_interleave(h // hkv, dim=2)
        g = log_decay(self.A_log, a[0], self.dt_bias)[1] if self.decay else None
        o = self._operator(q, k, v, g, slot, cu_seqlens)
        o = self.norm(o, gate.view(b, t, h, d))
        return self.o_proj(o.reshape(b, t, h * d))

    def _operator(self, q, k, v, g, slot, cu_seqlens):
        """The operator on q, k, v [B, T, H, D] and g [B, T, H] or None; with a cache slot, continue its state and
        store the new one."""
        state = read_operator_state(self.operator, slot)
        o, state = run_operator(self.operator, q, k, v, g, state, slot is not None, cu_seqlens,
                                decay=self.decay_convention, normalize=self.normalize, backend=self.backend)
        if slot is not None:
            write_operator_state(slot, state)
        return o

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the operator's linear_attn passes (chunk C = min(64, seq_len)) and the short
        convs (projections count as 6 x their params in the model's total).

        Each pass LA(Q, K, W) with K key columns and W value columns costs, forward, per head and token, what the
        chunked linear_attn costs (as in the Mamba-2 mixer): 2C(K + W) + 4KW. With Vs = V (+ 1 with normalize,
        the denominator column) and K = V = head_dim: operator_pass_flops(operator, C, K, Vs). The backward is
        counted as twice the forward (3x in all).
        """
        c = min(PASS_CHUNK, seq_len)
        forward = operator_pass_flops(self.operator, c, self.head_dim, self.head_dim + (1 if self.normalize else 0))
        conv = 0.0
        if self.conv_size is not None:
            conv = self.q_conv.flops_per_token() + self.k_conv.flops_per_token() + self.v_conv.flops_per_token()
        return float(3 * self.num_heads * forward + conv)
