"""The cost of one cached decoding step, as generate() takes it, does not depend on the context.

A step of a constant-state family (Mamba-2, Gated DeltaNet, the HLA shells) must do the same work at any context
length, a log-linear step work in its O(log T) levels only, and softmax attention may only read its KV cache (a
view and the attention kernel, no copy of it); no step may read a device value on the host (.item(), .tolist(),
bool(tensor), nonzero, a copy to or from the CPU), which would stall the GPU at every token.

The step runs on the meta device: no arithmetic happens, so a context of half a million tokens costs nothing,
while every op still reports the shapes it reads and writes, and any host read of a value raises. The cache holds
meta tensors of the shapes models.cache.expected_state_shapes gives for the context, and the model's
max_position_embeddings is larger still, so per-step work in the context or in the maximum position shows up as
an op touching a tensor with a dimension that large: nothing else in these tiny models is.
"""

import contextlib
from typing import NamedTuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import models.mixers.attention as attention_module
from hilo_kernels import softmax_attn
from models import HiloCache, build_model
from models.cache import expected_state_shapes

MAX_POSITIONS = 1 << 21
# Two contexts with the same number of log-linear levels (bit_length(T) + 1 for positions in [2^19, 2^20)), so a
# step at either must run the same ops on the same shapes, unless it reads the KV cache.
CONTEXTS = ((1 << 19) + 7, (1 << 20) - 9)
LARGE = 1 << 18  # no weight or state of these models has a dimension this large: a dimension >= it is the context
HOST_READS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "tolist", "allclose"}

BASE = {"vocab_size": 61, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "max_position_embeddings": MAX_POSITIONS}
MAMBA = {"head_dim": 16, "state_size": 8}
GDN = {"head_dim": 16, "num_heads": 2, "expand_v": 2}
FAMILIES = {
    "transformer": {"mixer": "attention", "num_kv_heads": 1},
    "mamba2": {"mixer": "mamba2", "mixer_kwargs": MAMBA},
    "gated_deltanet": {"mixer": "gated_deltanet", "mixer_kwargs": GDN},
    "loglinear_mamba2": {"mixer": "loglinear_mamba2", "mixer_kwargs": MAMBA},
    "loglinear_gated_deltanet": {"mixer": "loglinear_gated_deltanet", "mixer_kwargs": GDN},
    "hla_transformer": {"mixer": "attention", "operator": "hla2", "num_kv_heads": 1,
                        "mixer_kwargs": {"decay": True, "conv_size": 3}},
    "hla_mamba2": {"mixer": "mamba2", "operator": "ahla", "mixer_kwargs": MAMBA},
    "hla_gated_deltanet": {"mixer": "gated_deltanet", "operator": "hla3", "mixer_kwargs": GDN},
    "hybrid": {"mixer": "mamba2", "attn_layers": [1], "pre_conv": 4, "mixer_kwargs": MAMBA},
}
KV_FAMILIES = {"transformer", "hybrid"}


class Op(NamedTuple):
    name: str
    inputs: tuple  # shapes of the tensor arguments
    outputs: tuple  # shapes of the tensor results
    devices: frozenset
    view: bool  # returns a view of an input (no data touched)
    in_attention: bool  # run by softmax_attn, the KV cache read


class OpRecorder(TorchDispatchMode):
    """Records every op dispatched as an Op."""

    def __init__(self):
        super().__init__()
        self.ops = []
        self.in_attention = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outs = [a for a in tree_flatten(out)[0] if isinstance(a, torch.Tensor)]
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        self.ops.append(Op(func._opname, tuple(tuple(a.shape) for a in ins), tuple(tuple(a.shape) for a in outs),
                           frozenset(a.device.type for a in ins + outs), view, self.in_attention))
        return out


def marking_attention(recorder: OpRecorder):
    """softmax_attn for the attention mixer that flags the ops it runs (its KV cache read) in the recorder."""

    def attention(*args, **kwargs):
        recorder.in_attention = True
        try:
            return softmax_attn(*args, **kwargs)
        finally:
            recorder.in_attention = False

    return attention


def meta_model(family: str):
    torch.manual_seed(0)
    return build_model({**BASE, **FAMILIES[family]}).eval().to("meta")


def meta_cache(config, context: int) -> HiloCache:
    """A cache that has seen `context` tokens: every slot holds meta tensors of the expected shapes; KV caches go in
    through update_kv, as a prefill puts them."""
    cache = HiloCache.from_config(config)
    for i, shapes in enumerate(expected_state_shapes(config, context)):
        state = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in shapes.items()}
        if "key" in state:
            cache.update_kv(i, state.pop("key"), state.pop("value"))
        cache[i].update(state)
    cache.seen_tokens = context
    return cache


def step(model, cache, recorder: OpRecorder | None = None) -> None:
    """One decoding step as generate() runs it: the newest token, the mask of every token so far, the cache,
    logits_to_keep=1; recorded by recorder when given."""
    ids = torch.zeros(1, 1, dtype=torch.long, device="meta")
    mask = torch.ones(1, cache.get_seq_length() + 1, dtype=torch.long, device="meta")
    with torch.no_grad(), recorder or contextlib.nullcontext():
        try:
            model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1)
        except (RuntimeError, NotImplementedError) as e:
            if "meta" not in str(e):
                raise
            pytest.fail(f"the decoding step reads a device value on the host: {e}")


def recorded_step(family: str, context: int, monkeypatch) -> list[Op]:
    """The ops of one step at `context` (after an unrecorded one, in which the KV buffers grow: amortised doubling,
    not per-step work)."""
    model = meta_model(family)
    cache = meta_cache(model.config, context)
    step(model, cache)
    recorder = OpRecorder()
    monkeypatch.setattr(attention_module, "softmax_attn", marking_attention(recorder))
    step(model, cache, recorder)
    return recorder.ops


def is_large(op: Op) -> bool:
    return any(dim >= LARGE for shape in op.inputs + op.outputs for dim in shape)


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_step_has_no_host_read_and_no_work_in_the_context(family, monkeypatch):
    ops = recorded_step(family, CONTEXTS[0], monkeypatch)
    reads = [op.name for op in ops if op.name in HOST_READS or op.devices - {"meta"}]
    assert not reads, f"{family}: the decoding step reads device values on the host: {reads}"
    # outside the attention kernel, context-sized tensors (generate's mask, the KV cache) may only be viewed
    work = [op for op in ops if is_large(op) and not op.view and not op.in_attention]
    assert not work, f"{family}: the step does work on context-sized tensors: {work[:5]}"
    if family in KV_FAMILIES:
        assert any(is_large(op) for op in ops if op.in_attention), f"{family}: the attention kernel did not read the KV cache"


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_step_is_the_same_at_two_contexts(family, monkeypatch):
    """The same ops on the same shapes at both contexts (a loop over positions would change the op count), but for
    the views of generate's mask and the KV cache read by the attention layers, whose sizes are the context."""
    short, long = (recorded_step(family, t, monkeypatch) for t in CONTEXTS)
    assert [op.name for op in short] == [op.name for op in long]
    differ = [(a, b) for a, b in zip(short, long) if a != b]
    assert all(is_large(a) and is_large(b) for a, b in differ), f"{family}: shapes depend on the context: {differ[:5]}"
