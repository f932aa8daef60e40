"""Softmax attention mixer: q/k/v/o projections, GQA, RoPE, hilo_kernels.softmax_attn, KV cache."""

import torch
from torch import nn

from hilo_kernels import softmax_attn
from models.casts import ProjectionInput
from models.registry import register_mixer
from models.rope import rope_tables, rotate


@register_mixer("attention")
class AttentionMixer(nn.Module):
    """Causal multi-head attention with num_kv_heads key/value heads and RoPE (theta = config.rope_theta).

    forward(hidden [B, T, C], position_ids [B, T], cu_seqlens, cache) -> [B, T, C]. With a cache, the new keys
    and values are appended to the layer's slot and the T new queries attend to the whole cache. Padded rows
    (models/padding.py): a packed prefill (cu_seqlens with a cache) stores the keys in the padded layout, and later
    forwards attend with the cache's key mask, so no query sees a pad.
    """

    def __init__(self, config, layer_idx: int):
        super().__init__()
        if config.main_mixer == "attention" and config.mixer_kwargs:
            raise ValueError(f"the attention mixer takes no mixer_kwargs, got {sorted(config.mixer_kwargs)}; "
                             f"use attn_backend / num_kv_heads / rope_theta")
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.backend = config.attn_backend
        c, h, hkv, d = config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(c, h * d, bias=False)
        self.k_proj = nn.Linear(c, hkv * d, bias=False)
        self.v_proj = nn.Linear(c, hkv * d, bias=False)
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
        x = ProjectionInput(hidden)  # one autocast copy of hidden saved for the three projections, not one each
        q, k, v = x.project([self.q_proj, self.k_proj, self.v_proj], self.fused_projections)
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim)
        tables = rope_tables(position_ids, self.head_dim, self.rope_theta)
        q, k = rotate(q, tables), rotate(k, tables)
        if cache is not None and cache.step_prepared:
            # a compiled decoding step (HiloCache.prepare_step): attend over the whole preallocated buffers with a
            # mask, so the step's shapes do not change with the position
            k, v, visible = cache.write_kv_step(self.layer_idx, k, v)
            o = softmax_attn(q, k, v, causal=True, key_mask=visible,
                             backend="naive" if self.backend == "naive" else "sdpa")
            return self.o_proj(o.reshape(b, t, self.num_heads * self.head_dim))
        key_mask = None
        if cache is not None and cu_seqlens is not None:
            # a padded prefill run packed (models/padding.py): the cache keeps the keys in the rows' padded layout
            cache.store_packed_kv(self.layer_idx, k, v)
        elif cache is not None:
            k, v = cache.update_kv(self.layer_idx, k, v)
            key_mask = cache.key_mask  # [B, past + T] when continuing padded rows: no query reads a pad
        if key_mask is not None:
            o = softmax_attn(q, k, v, causal=True, key_mask=key_mask,
                             backend="naive" if self.backend == "naive" else "sdpa")
        else:
            o = softmax_attn(q, k, v, causal=True, cu_seqlens=cu_seqlens, backend=self.backend)
        return self.o_proj(o.reshape(b, t, self.num_heads * self.head_dim))

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the score and value matmuls (projections count as 6 x their params).

        Forward, per head and per visible key: q.k and p.v cost 2 * D FLOPs each; a causal query sees
        seq_len / 2 keys on average, so 2 * H * D * seq_len; the backward costs twice the forward, giving
        6 * H * D * seq_len (= 12 * H * D * seq_len / 2).
        """
        return 6.0 * self.num_heads * self.head_dim * seq_len
