"""compile_decoding on CPU: every family's compiled single-token steps give the eager greedy tokens, across a KV
buffer doubling (64 tokens) and a new log-linear level (position 32), with no graph break and a handful of compiled
graphs (none per token); generate() takes the compiled path; training forwards stay eager.

Every family compiles with "aot_eager" (dynamo's capture, graph breaks and guards, no code generation); the
Transformer and Mamba-2 also with inductor, the default backend. A compiled step reads the whole preallocated KV
buffers with a key mask (HiloCache.write_kv_step), so no shape follows the position: the KV length used to be a
dynamic size, and dynamo failed creating its guards ("sources must not be empty for symbol") in CI."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from benchmarks.decode import FAMILIES, build, prefill

PROMPT, STEPS = 30, 40  # positions 30..69: level 6 of the log-linear state at 32, the KV buffer past 64


def _greedy(model, steps=STEPS):
    prompt = torch.randint(0, 97, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache, tok = prefill(model, prompt)
        out = []
        for _ in range(steps):
            logits = model(input_ids=tok, cache=cache, use_cache=True, logits_to_keep=1).logits
            tok = logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(tok))
    return out, cache


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_steps_give_the_eager_tokens(family):
    model, _ = build(family, "tiny", 1024, [], 97, torch.device("cpu"), torch.float32)
    eager, eager_cache = _greedy(model)
    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    model.compile_decoding(backend=backend)
    compiled, cache = _greedy(model)
    model.compile_decoding(enabled=False)
    assert compiled == eager
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert 1 <= backend.frame_count <= 3  # recompiles only when the level count grows (log-linear)
    assert cache.get_seq_length() == eager_cache.get_seq_length() == PROMPT + STEPS
    assert not cache.step_prepared


def test_inductor_transformer_across_buffer_doublings():
    """The default backend over 100 steps (the KV buffers double at 64 and 128): eager tokens, slots that show
    exactly the tokens so far, and at most one graph per buffer size."""
    model, _ = build("transformer", "tiny", 1024, [], 97, torch.device("cpu"), torch.float32)
    eager, _ = _greedy(model, steps=100)
    torch._dynamo.reset()
    backend = CompileCounterWithBackend("inductor")
    model.compile_decoding(backend=backend)
    compiled, cache = _greedy(model, steps=100)
    model.compile_decoding(enabled=False)
    assert compiled == eager
    assert backend.frame_count <= 3
    assert all(slot["key"].shape[1] == PROMPT + 100 for slot in cache.layers)


def test_inductor_and_generate():
    model, _ = build("mamba2", "tiny", 1024, [], 97, torch.device("cpu"), torch.float32)
    prompt = torch.randint(0, 97, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    eager = model.generate(prompt, max_new_tokens=12, do_sample=False)
    torch._dynamo.reset()
    model.compile_decoding()
    compiled_step, steps = model.model._decode_step, []
    model.model._decode_step = lambda *a: steps.append(1) or compiled_step(*a)
    assert torch.equal(model.generate(prompt, max_new_tokens=12, do_sample=False), eager)
    assert len(steps) == 11  # every token after the prompt's forward
    # a training forward (gradients on) does not take the compiled path
    calls = []
    model.model._decode_step = lambda *a: calls.append(a)
    model.train()
    model(input_ids=prompt[:, :8], labels=prompt[:, :8]).loss.backward()
    assert not calls
    model.compile_decoding(enabled=False)
    assert model.model._decode_step is None


@pytest.mark.parametrize("family", ["transformer", "mamba2", "loglinear_mamba2"])
def test_beam_search_of_two_rows(family):
    """Beam search reorders the cache's states between steps (HiloCache.reorder_cache): the compiled steps follow
    it and give the eager beams."""
    model, _ = build(family, "tiny", 1024, [], 97, torch.device("cpu"), torch.float32)
    prompt = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(3))
    kw = {"max_new_tokens": 12, "do_sample": False, "num_beams": 3, "pad_token_id": 0, "eos_token_id": None}
    eager = model.generate(prompt, **kw)
    torch._dynamo.reset()
    model.compile_decoding(backend="aot_eager")
    assert torch.equal(model.generate(prompt, **kw), eager)
    model.compile_decoding(enabled=False)


@pytest.mark.parametrize("family", ["mamba2", "gated_deltanet", "hla_transformer", "loglinear_mamba2"])
def test_compiled_steps_update_states_in_place(family):
    """Under CUDA graphs a state returned by one step and read by the next is overwritten by that next replay, so
    compiled steps keep every recurrent state in one buffer (fixed address, marked static) and update it in
    place: after the first compiled step the slots hold the same tensors, at the same addresses, to the end."""
    model, _ = build(family, "tiny", 1024, [], 97, torch.device("cpu"), torch.float32)
    eager, _ = _greedy(model, steps=6)
    torch._dynamo.reset()
    model.compile_decoding(backend="aot_eager")
    prompt = torch.randint(0, 97, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    seen, out = [], []
    with torch.no_grad():
        cache, tok = prefill(model, prompt)
        for _ in range(6):
            tok = model(input_ids=tok, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, True)
            out.append(int(tok))
            seen.append({(i, n): (t, t.data_ptr()) for i, slot in enumerate(cache.layers) for n, t in slot.items()})
    model.compile_decoding(enabled=False)
    assert out == eager
    assert seen[0], "no recurrent state"
    for later in seen[1:]:
        if family == "loglinear_mamba2" and later.keys() != seen[0].keys():
            continue
        for key, (t, ptr) in later.items():
            if family == "loglinear_mamba2" and t.shape != seen[0][key][0].shape:
                continue  # a new level: a new buffer, once
            assert t is seen[0][key][0] and ptr == seen[0][key][1], key
