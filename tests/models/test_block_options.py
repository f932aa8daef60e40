"""Block options of the MQAR recipe: mlp=False (mixer-only blocks), pre_conv=K (a short conv before the mixer) and
embed_dropout (Zoology's dropout on the token embeddings)."""

import json

import pytest
import torch
import torch.nn.functional as F

from models import HiloConfig, HiloForCausalLM, build_model

VOCAB = 61
MIXERS = {
    "attention": {},
    "mamba2": {"head_dim": 16, "state_size": 8},
    "gated_deltanet": {"head_dim": 16},
    "loglinear_mamba2": {"head_dim": 16, "state_size": 8},
    "loglinear_gated_deltanet": {"head_dim": 16},
}


def tiny(mixer="attention", **overrides):
    cfg = {"vocab_size": VOCAB, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "mixer": mixer,
           "mixer_kwargs": MIXERS[mixer], "max_position_embeddings": 64, **overrides}
    torch.manual_seed(0)
    return build_model(cfg).eval()


def test_mlp_false_has_no_mlp_parameters():
    with_mlp, without = tiny(), tiny(mlp=False)
    assert not [n for n, _ in without.named_parameters() if ".mlp" in n]
    c, i, layers = 32, with_mlp.config.intermediate_size, 2
    count = lambda m: sum(p.numel() for p in m.parameters())
    # SwiGLU (gate, up, down: 3 * C * I) and its RMSNorm (C) per layer
    assert count(with_mlp) - count(without) == layers * (3 * c * i + c)
    h = torch.randn(2, 5, c)
    block = without.model.layers[0]
    expected = h + block.mixer(block.mixer_norm(h), torch.arange(5).expand(2, 5))
    torch.testing.assert_close(block(h, torch.arange(5).expand(2, 5)), expected)


@pytest.mark.parametrize("kernel", [1, 3, 4])
def test_pre_conv_is_the_causal_depthwise_conv_before_the_mixer(kernel):
    model = tiny(mlp=False, pre_conv=kernel)
    block = model.model.layers[1]
    with torch.no_grad():
        block.pre_conv.conv.weight.normal_()
    assert block.pre_conv.conv.bias is None and block.pre_conv.activation is None
    h = torch.randn(2, 7, 32)
    pos = torch.arange(7).expand(2, 7)
    x = block.mixer_norm(h)
    w = block.pre_conv.conv.weight[:, 0, :]  # [C, K]; w[:, K-1] multiplies the current token
    conv = torch.zeros_like(x)
    for t in range(7):
        for lag in range(min(kernel, t + 1)):
            conv[:, t] += w[:, kernel - 1 - lag] * x[:, t - lag]
    torch.testing.assert_close(block(h, pos), h + block.mixer(conv, pos), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_pre_conv_decode_matches_full_forward(mixer):
    model = tiny(mixer, mlp=False, pre_conv=4)
    x = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        out = model(x[:, :6], use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        assert all("pre_conv_state" in cache[i] for i in range(2))
        steps = [out.logits]
        for t in range(6, 13):
            steps.append(model(x[:, t:t + 1], cache=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-4)


def test_pre_conv_restarts_at_document_boundaries():
    model = tiny("mamba2", pre_conv=3)
    a = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    b = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        packed = model(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 5, 13])).logits
        alone = torch.cat([model(a, use_cache=False).logits, model(b, use_cache=False).logits], 1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-4)


def test_flops_count_the_pre_conv():
    plain, conv = tiny(mlp=False), tiny(mlp=False, pre_conv=4)
    assert conv.num_flops_per_token(64) - plain.num_flops_per_token(64) == 2 * 6 * 4 * 32


def test_old_config_without_the_fields_loads(tmp_path):
    model = tiny("mamba2")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("mlp", "pre_conv"):
        config.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = HiloForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.mlp is True and loaded.config.pre_conv is None
    assert all(block.pre_conv is None and block.mlp is not None for block in loaded.model.layers)
    x = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits)


def test_new_fields_round_trip(tmp_path):
    model = tiny(mlp=False, pre_conv=4)
    model.save_pretrained(tmp_path)
    loaded = HiloForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.mlp is False and loaded.config.pre_conv == 4
    x = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits)


@pytest.mark.parametrize("kwargs, error", [({"pre_conv": 0}, ValueError), ({"pre_conv": 2.5}, ValueError),
                                           ({"pre_conv": True}, ValueError), ({"mlp": "no"}, TypeError),
                                           ({"embed_dropout": 1.0}, ValueError), ({"embed_dropout": -0.1}, ValueError),
                                           ({"embed_dropout": "0.1"}, ValueError)])
def test_bad_values_are_refused(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        HiloConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2, **kwargs)


def test_mlp_false_trains():
    model = tiny(mlp=False, pre_conv=4).train()
    x = torch.randint(0, VOCAB, (2, 9))
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["model.layers.0.pre_conv.conv.weight"].abs().sum() > 0
    assert F.cross_entropy(model(x).logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1)).isfinite()


def test_embed_dropout_drops_embeddings_in_training_only(tmp_path):
    model = tiny("mamba2", embed_dropout=0.5)
    plain = tiny("mamba2")  # the same weights (same seed), no dropout
    x = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, plain(x).logits)  # eval: the identity
        model.train()
        hidden = {}
        hook = model.model.layers[0].register_forward_pre_hook(lambda m, args: hidden.update(h=args[0]))
        model(x)
        hook.remove()
    embedded = plain.model.embed_tokens(x)
    dropped = hidden["h"] == 0
    assert 0.3 < dropped.float().mean() < 0.7  # about half the entries are zeroed
    torch.testing.assert_close(hidden["h"][~dropped], 2 * embedded[~dropped])  # the others scaled by 1 / (1 - p)
    model.save_pretrained(tmp_path)
    assert HiloForCausalLM.from_pretrained(tmp_path).config.embed_dropout == 0.5
