"""Log-linear level scales shared by the log-linear Mamba-2 and Gated DeltaNet mixers (docs/kernels.md), and their
per-level decoding state in a HiloCache slot.

Per head h, level l and token t:   lambda_t[l] = softplus(L[h, l] * dl_t[h, l])
with dl a per-token linear projection of the layer input (H * num_levels outputs) and L a [H, num_levels]
parameter initialised to ones and excluded from weight decay (flagged `_no_weight_decay`).

Levels: a model trained with max_position_embeddings positions has num_levels = bit_length(max_position_embeddings
- 1) + 1 levels, the ones its positions use (level l >= 1 holds 2^(l-1) tokens). Past the trained maximum, a
position p needs bit_length(p) + 1 levels; the levels beyond the last trained one are clamped to it:
lambda_t[l] = lambda_t[num_levels - 1] for l >= num_levels. Longer sequences and decoding therefore run with the
same parameters. A call computes exactly the levels its positions reach (fewer than num_levels for short
sequences: the others are empty buckets), so a decoding state holds bit_length(position) + 1 levels.
"""

import torch
import torch.nn.functional as F
from torch import nn

from hilo_kernels.loglinear_attn import LogLinearState, num_levels
from models.gates import no_weight_decay

# HiloCache slot keys of the per-level state (the two fields of kernels' LogLinearState, kept as tensors so the
# cache can reorder and repeat batch rows).
LEVELS_KEY, TOKENS_KEY = "recurrent_levels", "recurrent_tokens"


class FlagsLevelParameter:
    """Mixin for the log-linear mixers: whatever parameter is registered as `L` is flagged `_no_weight_decay`, also
    when it replaces the original (transformers' from_pretrained assigns a fresh nn.Parameter, dropping attributes
    of the one built in __init__)."""

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        super().register_parameter(name, param)
        if name == "L" and param is not None:
            no_weight_decay(param)


def trained_levels(max_position_embeddings: int) -> int:
    """num_levels = bit_length(max_position_embeddings - 1) + 1: the levels of positions 0..max - 1."""
    if max_position_embeddings < 1:
        raise ValueError(f"max_position_embeddings must be >= 1, got {max_position_embeddings}")
    return num_levels(max_position_embeddings)


def level_parameter(num_heads: int, levels: int) -> nn.Parameter:
    """L [num_heads, levels], ones, flagged for no weight decay."""
    return no_weight_decay(nn.Parameter(torch.ones(num_heads, levels)))


def level_scales(L: torch.Tensor, dl: torch.Tensor, levels: int) -> torch.Tensor:
    """lambda [..., H, levels] fp32 from L [H, Lt] and dl [..., H * Lt]: softplus(L * dl), cut to `levels` when
    fewer are needed, or padded by repeating level Lt - 1 (the clamp past the trained maximum) when more are."""
    h, trained = L.shape
    lam = F.softplus(L.float() * dl.float().unflatten(-1, (h, trained)))
    if levels <= trained:
        return lam[..., :levels]
    return torch.cat([lam, lam[..., -1:].expand(*lam.shape[:-1], levels - trained)], -1)


def levels_reached(t: int, past: int, cu_seqlens: torch.Tensor | None) -> int:
    """Levels the positions of a call reach: num_levels(past + t) for rows that continue after `past` tokens, or
    num_levels(longest document) for packed documents (cu_seqlens, positions restart at 0 in each; read on the
    host, as the operators do)."""
    if cu_seqlens is None:
        return num_levels(past + t)
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    return num_levels(int((cu[1:] - cu[:-1]).max()))


def grow_cached_levels(cache, total_tokens: int) -> None:
    """Grow every per-level state a cache holds to num_levels(total_tokens), what a call ending at that many tokens
    reaches (HiloCache.prepare_step, on the host before a compiled decoding step: HiloModel.compile_decoding)."""
    levels = num_levels(total_tokens)
    for slot in cache.layers:
        state = read_level_state(slot)
        if state is not None and state.levels.shape[2] < levels:
            write_level_state(slot, state.grow(levels))


def decode_levels(state: LogLinearState | None, t: int, cache, cu_seqlens) -> int:
    """The levels a mixer's call works with: levels_reached(t, past, cu_seqlens), except for one token continuing a
    state after cache.prepare_step (a compiled decoding step), which has grown the state already: its level count
    is used without reading the position (which compiled code would otherwise specialise on, token by token)."""
    if state is not None and t == 1 and cu_seqlens is None and cache is not None and cache.step_prepared:
        return state.levels.shape[2]
    return levels_reached(t, cache.get_seq_length() if cache is not None else 0, cu_seqlens)


def read_level_state(slot: dict | None) -> LogLinearState | None:
    """The per-level state kept in a cache slot, or None (no cache, or nothing consumed yet)."""
    if slot is None or LEVELS_KEY not in slot:
        return None
    return LogLinearState(slot[LEVELS_KEY], slot[TOKENS_KEY])


def write_level_state(slot: dict, state: LogLinearState) -> None:
    """Store state in the slot as "recurrent_levels" [B, H, levels, K, V] fp32 and "recurrent_tokens" [B]."""
    slot[LEVELS_KEY], slot[TOKENS_KEY] = state.levels, state.tokens
