"""models: HiloForCausalLM on the tiny shape (CPU, fp32)."""

import math

import pytest
import torch
from torch import nn

import models
from models import HiloConfig, HiloForCausalLM, build_model, register_mixer
from models.mixers.attention import AttentionMixer

VOCAB = 97
TINY = {"vocab_size": VOCAB, "hidden_size": 128, "num_layers": 4, "num_heads": 4}


def tiny(seed=0, **overrides) -> HiloForCausalLM:
    torch.manual_seed(seed)
    return build_model({**TINY, **overrides}).eval()


def tokens(*shape, seed=0):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tie", [False, True])
def test_forward_backward_finite_with_all_grads(tie):
    model = tiny(tie_word_embeddings=tie, num_kv_heads=2).train()
    x = tokens(2, 37)
    out = model(x, labels=x)
    assert out.logits.shape == (2, 37, VOCAB)
    assert torch.isfinite(out.loss) and abs(out.loss.item() - math.log(VOCAB)) < 0.5
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie


def test_loss_is_shifted_fp32_cross_entropy_ignoring_minus_100():
    model = tiny()
    x = tokens(2, 13, seed=1)
    labels = x.clone()
    labels[0, 5:9] = -100
    out = model(x, labels=labels)
    logp = torch.log_softmax(out.logits.double(), -1)
    terms = [-logp[b, t, labels[b, t + 1]] for b in range(2) for t in range(12) if labels[b, t + 1] != -100]
    assert torch.allclose(out.loss.double(), torch.stack(terms).mean(), atol=1e-5)


def test_init_std_and_residual_scaling():
    model = tiny(num_layers=8, hidden_size=256, num_heads=4, initializer_range=0.05)
    block = model.model.layers[3]
    assert abs(block.mixer.q_proj.weight.std().item() - 0.05) < 0.004
    assert abs(model.model.embed_tokens.weight.std().item() - 0.05) < 0.004
    scaled = 0.05 / math.sqrt(2 * 8)
    assert abs(block.mixer.o_proj.weight.std().item() - scaled) < 0.002
    assert abs(block.mlp.down_proj.weight.std().item() - scaled) < 0.002
    assert torch.equal(block.mixer_norm.weight, torch.ones(256))


def test_generate_uses_cache_and_equals_greedy_full_forwards():
    model = tiny(seed=1, num_kv_heads=2)
    prompt = tokens(1, 6, seed=2)
    fed = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, inp, out: fed.append(inp[0].shape[1]))
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    hook.remove()
    assert fed == [6] + [1] * 9  # prompt once, then only the newest token each step
    seq = prompt
    with torch.no_grad():
        for _ in range(10):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(generated, seq)


def test_cached_logits_equal_full_forward_logits():
    model = tiny(seed=2, num_kv_heads=1)
    x = tokens(2, 20, seed=3)
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        out = model(x[:, :8], use_cache=True)
        cache = out.get("cache", out.get("past_key_values"))
        steps = [out.logits]
        for a, b in [(8, 9), (9, 12), (12, 13), (13, 20)]:  # single tokens and chunks (Tq < Tk)
            steps.append(model(x[:, a:b], past_key_values=cache, use_cache=True).logits)
    assert cache.get_seq_length() == 20
    assert cache[0]["key"].shape == (2, 20, 1, 32)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=0)


def test_varlen_packed_equals_documents_one_by_one():
    model = tiny(seed=3, num_kv_heads=2)
    lengths = [5, 1, 15, 9]
    docs = [tokens(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    packed = torch.cat(docs, dim=1)
    cu = torch.tensor([0, 5, 6, 21, 30])
    with torch.no_grad():
        out = model(packed, cu_seqlens=cu, labels=packed)
        singles = [model(d, labels=d) for d in docs]
    torch.testing.assert_close(out.logits, torch.cat([s.logits for s in singles], dim=1), atol=1e-5, rtol=0)
    # token-weighted mean of per-document losses (a length-1 document has no target)
    total = sum(s.loss * (n - 1) for s, n in zip(singles, lengths) if n > 1)
    torch.testing.assert_close(out.loss, total / sum(n - 1 for n in lengths), atol=1e-5, rtol=0)
    # explicit restart-per-document positions give the same result; global positions do not
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    seen = []
    hook = model.model.layers[0].mixer.register_forward_pre_hook(lambda m, args: seen.append(args[1]))
    with torch.no_grad():
        same = model(packed, cu_seqlens=cu, position_ids=pos).logits
        model(packed, cu_seqlens=cu)
        unpacked = model(packed).logits
    hook.remove()
    # RoPE scores are shift-invariant, so check the positions the mixers receive directly
    assert torch.equal(seen[0], pos) and torch.equal(seen[1], pos)
    torch.testing.assert_close(same, out.logits, atol=1e-6, rtol=0)
    assert (unpacked[:, 5:] - out.logits[:, 5:]).abs().max() > 1e-3


def test_logits_to_keep():
    model = tiny()
    x = tokens(2, 11)
    with torch.no_grad():
        full = model(x).logits
        torch.testing.assert_close(model(x, logits_to_keep=3).logits, full[:, -3:])
        torch.testing.assert_close(model(x, logits_to_keep=torch.tensor([0, 4])).logits, full[:, [0, 4]])
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(x, labels=x, logits_to_keep=1)


@pytest.mark.parametrize("tie", [False, True])
def test_save_and_auto_load_round_trip(tmp_path, tie):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = tiny(seed=4, tie_word_embeddings=tie, num_kv_heads=2, rope_theta=500.0)
    model.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "hilo"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, HiloForCausalLM)
    assert loaded.config.rope_theta == 500.0 and loaded.config.num_kv_heads == 2
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie
    x = tokens(2, 16, seed=5)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


@register_mixer("test_shift")
class ShiftMixer(nn.Module):
    """A causal stand-in for a recurrent mixer: mixes each token with its predecessor (no cache support)."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.weight = config.mixer_kwargs.get("weight", 0.5)

    def forward(self, hidden, position_ids, cu_seqlens=None, cache=None):
        prev = torch.nn.functional.pad(hidden, (0, 0, 1, 0))[:, :-1]
        prev = torch.where((position_ids == 0)[..., None], torch.zeros_like(prev), prev)
        return self.proj(hidden + self.weight * prev)

    def flops_per_token(self, seq_len):
        return 0.0


def test_hybrid_attn_layers_build_and_run():
    model = tiny(mixer="test_shift", attn_layers=[1, 3], mixer_kwargs={"weight": 0.25})
    kinds = [type(b.mixer) for b in model.model.layers]
    assert kinds == [ShiftMixer, AttentionMixer, ShiftMixer, AttentionMixer]
    assert model.model.layers[0].mixer.weight == 0.25
    x = tokens(1, 12)
    out = model(x, labels=x)
    assert torch.isfinite(out.loss)
    # flops: the shift layers add only their projection; attention layers their causal term
    n_lin = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert model.num_flops_per_token(64) == 6 * n_lin + 2 * 6 * 128 * 64


def test_build_model_errors_and_hydra_keys():
    with pytest.raises(ValueError, match=r"unknown model config key\(s\) \['hiden_size'\].*valid keys.*hidden_size"):
        build_model({**TINY, "hiden_size": 64})
    with pytest.raises(ValueError, match=r"unknown mixer 'mamba9'.*registered mixers.*'attention'"):
        build_model({**TINY, "mixer": "mamba9"})
    with pytest.raises(ValueError, match="num_kv_heads"):
        build_model({**TINY, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="out of range"):
        build_model({**TINY, "attn_layers": [4]})
    model = build_model({**TINY, "name": "transformer", "size_name": "tiny"})
    assert model.config.intermediate_size == 512 and model.config.head_dim == 32


def test_bad_forward_inputs_are_clear_errors():
    model = tiny()
    x = tokens(2, 8)
    with pytest.raises(ValueError, match=r"attention_mask must be \[B, T\]"):
        model(x, attention_mask=torch.ones(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="not both"):
        model(x[:1], attention_mask=torch.tensor([[0] + [1] * 7]), cu_seqlens=torch.tensor([0, 3, 7]))
    with pytest.raises(ValueError, match="batch size 1"):
        model(x, cu_seqlens=torch.tensor([0, 3, 8]))
    model(x, attention_mask=torch.ones(2, 8, dtype=torch.long))  # all-ones masks are fine


def test_num_flops_per_token_hand_count():
    model = tiny()
    # per layer: q, k, v, o 4 * 128 * 128; SwiGLU 128 * 2 * 512 + 512 * 128; LM head 128 * 97
    n = 4 * (4 * 128 * 128 + 128 * 1024 + 512 * 128) + 128 * VOCAB
    for t in (1, 256, 2048):
        assert model.num_flops_per_token(t) == 6 * n + 4 * 6 * 128 * t


def test_gradient_checkpointing_gives_same_grads():
    x = tokens(1, 20)
    grads = []
    for ckpt in (False, True):
        model = tiny(seed=5).train()
        if ckpt:
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
            assert model.model.gradient_checkpointing
        model(x, labels=x).loss.backward()
        grads.append(model.model.layers[0].mixer.q_proj.weight.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_config_is_registered_with_auto_classes():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("hilo", hidden_size=64, num_layers=2, num_heads=2)
    assert isinstance(cfg, HiloConfig) and cfg.num_hidden_layers == 2 and cfg.num_attention_heads == 2
    assert "attention" in models.MIXERS


def test_training_forward_builds_no_cache():
    import models

    model = models.build_model({"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 2})
    ids = torch.randint(0, 64, (2, 8))
    model.train()
    assert model(input_ids=ids).past_key_values is None
    model.eval()
    assert model(input_ids=ids).past_key_values is not None  # HF default for inference: a cache to continue from
    assert model(input_ids=ids, use_cache=False).past_key_values is None


def test_kv_cache_appends_into_doubling_buffers():
    from models.cache import HiloCache

    cache = HiloCache([True])
    gen = torch.Generator().manual_seed(0)
    keys, values, storages = [], [], set()
    for t in (5, 1, 1, 70, 1, 1, 200, 1):
        k, v = torch.randn(2, t, 3, 4, generator=gen), torch.randn(2, t, 3, 4, generator=gen)
        keys.append(k)
        values.append(v)
        full_k, full_v = cache.update_kv(0, k, v)
        storages.add(full_k.untyped_storage().data_ptr())
        assert torch.equal(full_k, torch.cat(keys, 1)) and torch.equal(full_v, torch.cat(values, 1))
    assert len(storages) <= 4  # 64 -> 128 -> 280 -> (no more): amortised growth, not a copy per token
    # a reorder (beam search) permutes the rows in place (the buffers keep their address, for CUDA graphs); later
    # appends continue from the reordered rows
    before = full_k.untyped_storage().data_ptr()
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(cache[0]["key"], torch.cat(keys, 1).flip(0))
    k, v = torch.randn(2, 1, 3, 4, generator=gen), torch.randn(2, 1, 3, 4, generator=gen)
    full_k, _ = cache.update_kv(0, k, v)
    assert torch.equal(full_k, torch.cat([torch.cat(keys, 1).flip(0), k], 1))
    assert full_k.untyped_storage().data_ptr() == before
    # a reorder to another batch size (not beam search's) selects new rows
    cache.reorder_cache(torch.tensor([1]))
    assert torch.equal(cache[0]["key"], full_k[1:])


def test_padding_mask_errors_name_the_fix():
    import models

    model = models.build_model({"vocab_size": 64, "hidden_size": 32, "num_layers": 1, "num_heads": 2})
    ids = torch.randint(0, 64, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        cache = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
        nxt = torch.randint(0, 64, (2, 1))
        with pytest.raises(ValueError, match="every token so far"):
            model(input_ids=nxt, cache=cache)
        with pytest.raises(ValueError, match="every token so far"):
            model(input_ids=nxt, attention_mask=torch.ones(2, 1, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="must be real"):
            model(input_ids=nxt, attention_mask=torch.cat([mask, torch.tensor([[1], [0]])], 1), cache=cache)
        with pytest.raises(ValueError, match="no real token"):
            model(input_ids=ids, attention_mask=torch.zeros_like(ids))
