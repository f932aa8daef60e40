"""HiloCache: the decoding state of every layer of a hilo model.

One slot (a dict of tensors) per layer. Attention layers keep "key"/"value" [B, T_past, Hkv, D]; recurrent
mixers keep whatever they need under their own names (e.g. "conv_state", "recurrent_state", per-level
states for log-linear mixers). The model counts processed tokens once per forward (advance), so
get_seq_length() is right for models without any attention layer too.

It is not a transformers.Cache subclass: the Cache base class changes between transformers releases, while
generate() only needs the methods below (HiloForCausalLM creates the cache itself and tells generate not to
build a DynamicCache).
"""

import torch


class HiloCache:
    """Per-layer decoding state. is_attention[i] tells whether layer i keeps a KV cache."""

    is_compileable = False

    def __init__(self, is_attention: list[bool]):
        self.is_attention = list(is_attention)
        self.layers: list[dict[str, torch.Tensor]] = [{} for _ in self.is_attention]
        self.seen_tokens = 0

    @classmethod
    def from_config(cls, config) -> "HiloCache":
        return cls([config.layer_mixer(i) == "attention" for i in range(config.num_layers)])

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer_idx: int) -> dict[str, torch.Tensor]:
        """The slot of layer layer_idx: a dict the layer's mixer reads and writes."""
        return self.layers[layer_idx]

    @property
    def is_linear(self) -> list[bool]:
        """Per layer: True when its state does not grow with the sequence (transformers' name for this)."""
        return [not a for a in self.is_attention]

    def update_kv(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append key/value [B, T_new, Hkv, D] to layer layer_idx's cache; return the full [B, T_past + T_new, ...]."""
        slot = self.layers[layer_idx]
        if "key" in slot:
            key = torch.cat((slot["key"], key), dim=1)
            value = torch.cat((slot["value"], value), dim=1)
        slot["key"], slot["value"] = key, value
        return key, value

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of tokens already processed (the position of the next token)."""
        return self.seen_tokens

    def advance(self, num_tokens: int) -> None:
        """Called by the model after each forward through all layers."""
        self.seen_tokens += num_tokens

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select batch rows beam_idx in every state (beam search)."""
        for slot in self.layers:
            for name, t in slot.items():
                slot[name] = t.index_select(0, beam_idx.to(t.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row repeats times (expanding a prompt's state for several samples)."""
        for slot in self.layers:
            for name, t in slot.items():
                slot[name] = t.repeat_interleave(repeats, dim=0)
