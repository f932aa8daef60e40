"""HiloCache: the decoding state of every layer of a hilo model.

One slot (a dict of tensors) per layer. Attention layers keep "key"/"value" [B, T_past, Hkv, D]; recurrent
mixers keep whatever they need under their own names (e.g. "conv_state", "recurrent_state", per-level
states for log-linear mixers). The model counts processed tokens once per forward (advance), so
get_seq_length() is right for models without any attention layer too. After a padded prefill (models/padding.py)
every row's states are its own sequence's and the KV caches keep the rows' padded layout (`padded`, `kv_valid`).

It is not a transformers.Cache subclass: the Cache base class changes between transformers releases, while
generate() only needs the methods below (HiloForCausalLM creates the cache itself and tells generate not to
build a DynamicCache).

expected_state_shapes / expected_state_bytes give, from a HiloConfig alone, what every layer's slot holds after a
number of tokens (the operators' state shapes, docs/kernels.md); HiloCache.state_bytes() measures the same quantity on a live cache.
"""

import math

import torch

from models.levels import grow_cached_levels
from models.padding import pad


class HiloCache:
    """Per-layer decoding state. is_attention[i] tells whether layer i keeps a KV cache."""

    is_compileable = False

    def __init__(self, is_attention: list[bool]):
        self.is_attention = list(is_attention)
        self.layers: list[dict[str, torch.Tensor]] = [{} for _ in self.is_attention]
        self.seen_tokens = 0
        self._kv_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (key, value) storage
        self.step_prepared = False  # prepare_step ran for the coming forward (cleared by advance)
        self.step_index = None  # [1] long on the KV buffers' device: the prepared step's position
        # layer -> {name: tensor}: the recurrent states (all but "key"/"value") a compiled step updates in place
        self._static_states: dict[int, dict[str, torch.Tensor]] = {}
        # padded batches (models/padding.py): whether the prefill's attention_mask had zeros (then every row's
        # states are its own sequence's, KV caches keep the padded layout and later forwards need the mask), and,
        # during one forward only, the packing of a padded prefill (attention layers store their keys through
        # store_packed_kv) or the key mask [B, past + T] of a forward that continues padded rows
        self.padded = False
        self.unpadded = None
        self.key_mask: torch.Tensor | None = None
        # with padded rows: bool [B, capacity] beside the KV buffers, False at the prefill's pads (True elsewhere: the
        # tokens after the prefill are real), which a compiled decoding step combines with its position's key mask
        self.kv_valid: torch.Tensor | None = None

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
        """Append key/value [B, T_new, Hkv, D] to layer layer_idx's cache; return the full [B, T_past + T_new, ...].

        The slot's "key"/"value" are views of buffers whose capacity doubles when full, so decoding T tokens
        copies O(T) values in all (a concatenation per token would copy the whole cache every step: O(T^2))."""
        slot = self.layers[layer_idx]
        past = slot["key"].shape[1] if "key" in slot else 0
        total = past + key.shape[1]
        buffers = self._grow_kv(layer_idx, key, value, total)
        buffers[0][:, past:total] = key
        buffers[1][:, past:total] = value
        slot["key"], slot["value"] = buffers[0][:, :total], buffers[1][:, :total]
        return slot["key"], slot["value"]

    def store_packed_kv(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """A padded prefill run packed (self.unpadded set by the model): key/value [1, N, Hkv, D] of the real
        tokens go into layer layer_idx's empty cache in the rows' padded layout [B, T, Hkv, D] (zeros at the pads,
        which the key masks of later steps leave out)."""
        self.update_kv(layer_idx, pad(key, self.unpadded), pad(value, self.unpadded))
        if self.kv_valid is None:
            real = pad(key.new_ones(1, key.shape[1], dtype=torch.bool), self.unpadded)  # [B, T]
            self._grow_kv_valid(self._kv_buffers[layer_idx][0].shape[1], real)

    def _grow_kv_valid(self, capacity: int, prefix: torch.Tensor | None = None) -> None:
        """kv_valid with `capacity` columns: the old columns (or `prefix` [B, T], the prefill's real tokens), then
        True; a static address, as the KV buffers have (compiled steps read it)."""
        old = self.kv_valid if prefix is None else prefix
        valid = torch.ones(old.shape[0], capacity, dtype=torch.bool, device=old.device)
        valid[:, :old.shape[1]] = old
        torch._dynamo.mark_static_address(valid, guard=False)
        self.kv_valid = valid

    def _grow_kv(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, total: int):
        """Layer layer_idx's (key, value) buffers with room for `total` tokens (and the slot's past copied in when
        they are new); key / value only give the shape and dtype of one token's entries."""
        slot = self.layers[layer_idx]
        past = slot["key"].shape[1] if "key" in slot else 0
        buffers = self._kv_buffers.get(layer_idx)
        if (buffers is None or buffers[0].shape[1] < total or buffers[0].dtype != key.dtype
                or not _is_prefix_view(slot.get("key"), buffers[0])):
            capacity = max(total, 2 * (buffers[0].shape[1] if buffers is not None else 0), 64)
            grown = []
            for name, new in (("key", key), ("value", value)):
                # zeros, not empty: a prepared step reads whole buffers, and 0 x NaN from unused memory is NaN
                buf = new.new_zeros(new.shape[0], capacity, *new.shape[2:])
                # written in place by compiled steps: a fixed address lets CUDA graphs (compile_decoding's
                # "reduce-overhead") keep them instead of skipping graphs with mutated inputs; a new buffer (a
                # doubling) re-records, it does not recompile (guard=False)
                torch._dynamo.mark_static_address(buf, guard=False)
                if past:
                    buf[:, :past] = slot[name]
                grown.append(buf)
            buffers = self._kv_buffers[layer_idx] = tuple(grown)
            if self.kv_valid is not None and self.kv_valid.shape[1] < capacity:
                self._grow_kv_valid(capacity)
        return buffers

    def prepare_step(self, total_tokens: int) -> None:
        """Before a single-token forward that ends at total_tokens (host code, run ahead of a compiled decoding
        step): KV caches make room for the token and their slots already show it (the step writes it through
        write_kv_step), and per-level (log-linear) states grow to the levels that position reaches. The step itself
        then only writes into buffers and reads whole ones: its shapes change only when a buffer doubles, never
        with the position, and it never branches on storage."""
        self.step_index = None
        for layer_idx, slot in enumerate(self.layers):
            if "key" in slot:
                key_buf, value_buf = self._grow_kv(layer_idx, slot["key"][:, :1], slot["value"][:, :1], total_tokens)
                slot["key"], slot["value"] = key_buf[:, :total_tokens], value_buf[:, :total_tokens]
                if self.step_index is None:  # made on the device by a kernel: no host-to-device copy, no sync
                    self.step_index = torch.full((1,), total_tokens - 1, dtype=torch.long, device=key_buf.device)
        grow_cached_levels(self, total_tokens)
        self._make_states_static()
        self.step_prepared = True

    def _make_states_static(self) -> None:
        """Every recurrent state becomes a buffer with a fixed address that compiled steps update in place
        (commit_step), as the KV buffers are. Under CUDA graphs ("reduce-overhead") a state returned by one replay
        and read by the next is an output the next replay overwrites ("accessing tensor output of CUDAGraphs that
        has been overwritten by a subsequent run"). A state is copied once, when it first meets a prepared step
        (or after it changed shape: a new log-linear level, a beam reshape)."""
        for layer_idx, slot in enumerate(self.layers):
            static = self._static_states.setdefault(layer_idx, {})
            for name, t in slot.items():
                if name in ("key", "value") or static.get(name) is t:
                    continue
                buf = t.clone(memory_format=torch.contiguous_format)
                torch._dynamo.mark_static_address(buf, guard=False)
                slot[name] = static[name] = buf

    def commit_step(self) -> None:
        """The end of a prepared step, inside the compiled code: copy each state the step computed into its static
        buffer and put the buffer back in the slot, so nothing the next step reads is an output of this one."""
        for layer_idx, static in self._static_states.items():
            slot = self.layers[layer_idx]
            for name, buf in static.items():
                new = slot.get(name)
                if new is not None and new is not buf and new.shape == buf.shape and new.dtype == buf.dtype:
                    buf.copy_(new)
                    slot[name] = buf

    def write_kv_step(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        """In a prepared step (prepare_step): write key/value [B, 1, Hkv, D] at the step's position of layer
        layer_idx's buffers; return the whole buffers [B, capacity, Hkv, D] and visible [capacity] (bool, True for
        positions up to the step's). Attention over the buffers with that key mask is attention over the cache."""
        key_buf, value_buf = self._kv_buffers[layer_idx]
        key_buf.index_copy_(1, self.step_index, key)
        value_buf.index_copy_(1, self.step_index, value)
        visible = torch.arange(key_buf.shape[1], device=key_buf.device) <= self.step_index
        if self.kv_valid is not None:  # padded rows: [B, capacity], without each row's pads
            visible = visible & self.kv_valid[:, :key_buf.shape[1]]
        return key_buf, value_buf, visible

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of tokens already processed (the position of the next token)."""
        return self.seen_tokens

    def advance(self, num_tokens: int) -> None:
        """Called by the model after each forward through all layers."""
        self.seen_tokens += num_tokens
        self.step_prepared = False
        self.unpadded = self.key_mask = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select batch rows beam_idx in every state (beam search). KV buffers are reordered in place (their
        addresses stay, so CUDA graphs of compiled decoding steps replay instead of re-recording)."""
        for layer_idx, slot in enumerate(self.layers):
            buffers = self._kv_buffers.get(layer_idx)
            in_place = (buffers is not None and buffers[0].shape[0] == len(beam_idx)
                        and _is_prefix_view(slot.get("key"), buffers[0])
                        and _is_prefix_view(slot.get("value"), buffers[1]))
            static = self._static_states.get(layer_idx, {})
            for name, t in slot.items():
                if in_place and name in ("key", "value"):
                    continue
                if static.get(name) is t and t.shape[0] == len(beam_idx):  # a compiled step's static state
                    t.copy_(t.index_select(0, beam_idx.to(t.device)))
                    continue
                slot[name] = t.index_select(0, beam_idx.to(t.device))
            if in_place:
                for buf in buffers:
                    buf.copy_(buf.index_select(0, beam_idx.to(buf.device)))
        if self.kv_valid is not None:
            rows = self.kv_valid.index_select(0, beam_idx.to(self.kv_valid.device))
            if rows.shape == self.kv_valid.shape:
                self.kv_valid.copy_(rows)
            else:
                self._grow_kv_valid(rows.shape[1], rows)

    def state_bytes(self) -> int:
        """Bytes of every tensor in every slot (numel * element size): the decoding state the cache holds, the
        quantity expected_state_bytes predicts."""
        return sum(t.numel() * t.element_size() for slot in self.layers for t in slot.values())

    def held_bytes(self) -> int:
        """Bytes of the distinct storages behind the slots' tensors: what the cache keeps allocated. It exceeds
        state_bytes() when a state is a view into a larger tensor (a short conv's state sliced from its input)."""
        storages = {}
        for slot in self.layers:
            for t in slot.values():
                storage = t.untyped_storage()
                storages[(t.device, storage.data_ptr())] = storage.nbytes()
        return sum(storages.values())

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row repeats times (expanding a prompt's state for several samples)."""
        for slot in self.layers:
            for name, t in slot.items():
                slot[name] = t.repeat_interleave(repeats, dim=0)
        if self.kv_valid is not None:
            self._grow_kv_valid(self.kv_valid.shape[1], self.kv_valid.repeat_interleave(repeats, dim=0))


def expected_state_shapes(config, seq_len: int, batch: int = 1,
                          dtype: torch.dtype = torch.float32) -> list[dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """Per layer, {slot key: (shape, dtype)} of what a HiloCache holds once `batch` rows of seq_len tokens have gone
    through a model of `config` whose activations are `dtype` (the parameter dtype: bf16 on GPU, fp32 on CPU).

    Recurrent states are fp32 whatever the activations (promote_types(dtype, float32)); KV caches and short-conv
    states are in the activation dtype. With Hkv = num_kv_heads, D = head_dim, Kc = a conv's kernel size:
      attention       "key", "value" [B, T, Hkv, D]                                 2 T Hkv D bytes(dtype)
      mamba2          "conv_state" [B, d_inner + 2 G N, Kc - 1], "recurrent_state" [B, H, N, P] fp32
                      (H = expand hidden / P heads of P channels, N = state_size, G = n_groups)
      gated_deltanet  "conv_q", "conv_k" [B, H K, Kc - 1], "conv_v" [B, H V, Kc - 1], "recurrent_state"
                      [B, H, K, V] fp32 (K = head_dim, V = expand_v K, H = num_heads or round(0.75 hidden / K))
      loglinear_*     the shell's convs, "recurrent_levels" [B, H, levels, K, V] fp32 with levels =
                      bit_length(T - 1) + 1 (one K x V state per Fenwick level the positions reach, so it
                      grows by one state at every power of two), and "recurrent_tokens" [B] int64
      hla             hilo_kernels.hla.state fields: hla2 "S" [B, H, D, D], "F" [B, H, D, Vs]; ahla "P", "E"
                      [B, H, D, Vs]; hla3 "S", "P", "F" (Vs = D, + 1 with normalize); "conv_q" [B, H D, Kc - 1],
                      "conv_k", "conv_v" [B, Hkv D, Kc - 1] with mixer_kwargs.conv_size
      hla_mamba2      "conv_state" as mamba2 and the operator's fields with (K, V) = (N, P)
      hla_gated_deltanet  the GDN convs and the operator's fields with (K, V) = (head_dim, expand_v head_dim)
    plus "pre_conv_state" [B, hidden, pre_conv - 1] on every layer when config.pre_conv is set. Only attention
    layers and log-linear levels depend on seq_len. seq_len 0 is an empty cache.
    """
    if seq_len < 0 or batch < 1:
        raise ValueError(f"expected_state_shapes needs seq_len >= 0 and batch >= 1, got {seq_len}, {batch}")
    if seq_len == 0:
        return [{} for _ in range(config.num_layers)]
    from hilo_kernels.hla.state import state_shapes
    from hilo_kernels.loglinear_attn import num_levels
    from models.mixers.gated_deltanet import default_num_heads
    from models.registry import MIXERS, mixer_options

    b = batch
    state_dtype = torch.promote_types(dtype, torch.float32)
    shapes = []
    for i in range(config.num_layers):
        name = config.layer_mixer(i)
        cls = MIXERS[name]
        slot: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        if name == "attention":
            kv = (b, seq_len, config.num_kv_heads, config.head_dim)
            slot.update(key=(kv, dtype), value=(kv, dtype))
        elif name == "hla":
            opts = mixer_options(name, config.mixer_kwargs, cls.DEFAULTS)
            h, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
            if opts["conv_size"] is not None:
                taps = int(opts["conv_size"]) - 1
                slot.update(conv_q=((b, h * d, taps), dtype), conv_k=((b, hkv * d, taps), dtype),
                            conv_v=((b, hkv * d, taps), dtype))
            fields = state_shapes(config.operator, b, h, d, d + (1 if opts["normalize"] else 0))
            slot.update({f: (s, state_dtype) for f, s in fields.items()})
        elif name in ("mamba2", "loglinear_mamba2", "hla_mamba2"):
            opts = mixer_options(name, config.mixer_kwargs, cls.DEFAULTS)
            p, n, groups = int(opts["head_dim"]), int(opts["state_size"]), int(opts["n_groups"])
            d_inner = int(opts["expand"] * config.hidden_size)
            h = d_inner // p
            slot["conv_state"] = ((b, d_inner + 2 * groups * n, int(opts["conv_size"]) - 1), dtype)
            slot.update(_recurrent_shapes(name, config, b, h, n, p, seq_len, state_dtype, state_shapes, num_levels))
        elif name in ("gated_deltanet", "loglinear_gated_deltanet", "hla_gated_deltanet"):
            opts = mixer_options(name, config.mixer_kwargs, cls.DEFAULTS)
            dk = int(opts["head_dim"])
            h = int(opts["num_heads"] or default_num_heads(config.hidden_size, dk))
            dv = int(opts["expand_v"] * dk)
            taps = int(opts["conv_size"]) - 1
            slot.update(conv_q=((b, h * dk, taps), dtype), conv_k=((b, h * dk, taps), dtype),
                        conv_v=((b, h * dv, taps), dtype))
            slot.update(_recurrent_shapes(name, config, b, h, dk, dv, seq_len, state_dtype, state_shapes, num_levels))
        else:
            raise ValueError(f"expected_state_shapes does not know what mixer {name!r} keeps in its cache slot")
        if getattr(config, "pre_conv", None):
            slot["pre_conv_state"] = ((b, config.hidden_size, config.pre_conv - 1), dtype)
        shapes.append(slot)
    return shapes


def _recurrent_shapes(name, config, b, h, dk, dv, seq_len, state_dtype, state_shapes, num_levels) -> dict:
    """The recurrent part of a Mamba-2 / GDN shell's slot: one K x V state, its log-linear levels, or HLA fields."""
    if name.startswith("loglinear_"):
        return {"recurrent_levels": ((b, h, num_levels(seq_len), dk, dv), state_dtype),
                "recurrent_tokens": ((b,), torch.int64)}
    if name.startswith("hla_"):
        return {f: (s, state_dtype) for f, s in state_shapes(config.operator, b, h, dk, dv).items()}
    return {"recurrent_state": ((b, h, dk, dv), state_dtype)}


def expected_state_bytes(config, seq_len: int, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of decoding state a HiloCache holds after seq_len tokens of `batch` rows (sum over
    expected_state_shapes): what HiloCache.state_bytes() measures. E.g. a Transformer's KV cache is
    2 * seq_len * num_kv_heads * head_dim * bytes(dtype) per layer and row; Mamba-2's H * N * P * 4 + its conv's
    (d_inner + 2 G N)(Kc - 1) bytes(dtype), independent of seq_len; a log-linear layer multiplies its recurrent
    state by bit_length(seq_len - 1) + 1 levels."""
    return sum(math.prod(shape) * dt.itemsize
               for slot in expected_state_shapes(config, seq_len, batch, dtype) for shape, dt in slot.values())


def _is_prefix_view(t: torch.Tensor | None, buffer: torch.Tensor) -> bool:
    """Whether t is buffer[:, :n] (the slot still points into the buffer: no reorder or repeat replaced it)."""
    return t is not None and t.data_ptr() == buffer.data_ptr() and t.stride() == buffer.stride()
