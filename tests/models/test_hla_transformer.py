"""models: the transformer shell with HLA operators (config.operator hla2 / ahla / hla3, models/mixers/hla.py).

The layer is checked against a definition written out here: the masked sums (docs/kernels.md) over index tuples (not the
linear_attn compositions the kernels use) wrapped in the layer's projections, feature maps, decay and gated norm.
"""

import json
import math

import family_checks as fc
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import HiloCache, HiloForCausalLM, build_config, build_model
from models.mixers.attention import AttentionMixer
from models.mixers.hla import HLAMixer
from models.rope import apply_rope, rope_cos_sin

VOCAB = 97
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "num_layers": 2, "num_heads": 2}
OPS = ["hla2", "ahla", "hla3"]


def small(op, seed=0, **overrides) -> HiloForCausalLM:
    torch.manual_seed(seed)
    return build_model({**SMALL, "operator": op, **overrides}).eval()


tokens = fc.token_maker(VOCAB)


# ---- the definition ------------------------------------------------------------------------------------------


def masked_operator(op, q, k, v, g, convention):
    """The HLA operators by brute force over index tuples, per batch row and head: q, k [B, T, H, K], v [B, T, H, V],
    g [B, T, H] or None. log b_t = sum_{r <= t} g_r; the weights are products of ratios b_x / b_y."""
    bsz, t, h, _ = q.shape
    lb = torch.zeros(bsz, t, h, dtype=q.dtype) if g is None else torch.cumsum(g.to(q.dtype), 1)
    a = torch.einsum("bthd,bshd->bhts", q, k)  # a[t, s] = q_t . k_s
    lb = lb.permute(0, 2, 1)  # [B, H, T]
    idx = torch.arange(t)

    def ratio(x, y):  # (b_x / b_y) on the grid of the two index tensors' broadcast
        return torch.exp(lb[..., x] - lb[..., y])

    if op == "hla2":
        tt, jj, ii = torch.meshgrid(idx, idx, idx, indexing="ij")
        mask = (ii <= jj) & (jj <= tt)
        if convention == "d1":
            w = ratio(tt, ii) * ratio(jj, ii)
        else:
            w = ratio(tt, ii) * ratio(tt, jj)
        # (q_t.k_i)(k_i.q_j) = a[t, i] a[j, i]
        coef = w * mask * a[..., tt, ii] * a[..., jj, ii]
        return torch.einsum("bhtji,bjhv->bthv", coef, v)
    if op == "ahla":
        tt, ii, jj = torch.meshgrid(idx, idx, idx, indexing="ij")
        mask = (jj <= ii) & (ii <= tt)
        coef = ratio(tt, jj) * mask * a[..., tt, ii] * a[..., ii, jj]
        return torch.einsum("bhtij,bjhv->bthv", coef, v)
    tt, jj, ii, ll = torch.meshgrid(idx, idx, idx, idx, indexing="ij")
    mask = (ii <= jj) & (ll <= jj) & (jj <= tt)
    w = ratio(tt, ii) * ratio(jj, ii) * ratio(jj, ll)
    coef = w * mask * a[..., tt, ii] * a[..., jj, ii] * a[..., jj, ll]
    return torch.einsum("bhtjil,blhv->bthv", coef, v)


def layer_definition(mixer: HLAMixer, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """The HLA layer (no short conv) from the mixer's weights, in x's dtype."""
    b, t, _ = x.shape
    h, hkv, d = mixer.num_heads, mixer.num_kv_heads, mixer.head_dim
    q = (x @ mixer.q_proj.weight.T).view(b, t, h, d)
    k = (x @ mixer.k_proj.weight.T).view(b, t, hkv, d).repeat_interleave(h // hkv, 2)
    v = (x @ mixer.v_proj.weight.T).view(b, t, hkv, d).repeat_interleave(h // hkv, 2)
    cos, sin = rope_cos_sin(position_ids, d, mixer.rope_theta)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if mixer.normalize:
        q, k = torch.where(q > 0, q + 1, torch.exp(q)), torch.where(k > 0, k + 1, torch.exp(k))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g = None
    if mixer.decay:
        g = -torch.exp(mixer.A_log) * F.softplus(x @ mixer.a_proj.weight.T + mixer.dt_bias)
    o = masked_operator(mixer.operator, q, k, v, g, mixer.decay_convention)
    if mixer.normalize:
        den = masked_operator(mixer.operator, q, k, torch.ones_like(v[..., :1]), g, mixer.decay_convention)
        o = o / torch.where(den >= 0, den.clamp(min=1e-6), den.clamp(max=-1e-6))
    o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + mixer.norm.eps) * mixer.norm.weight
    gate = (x @ mixer.g_proj.weight.T).view(b, t, h, d)
    o = o * gate * torch.sigmoid(gate)
    return o.reshape(b, t, h * d) @ mixer.o_proj.weight.T


@pytest.mark.parametrize("op, kwargs, heads", [  # heads: (num_heads, num_kv_heads)
    ("hla2", {}, (2, 2)),
    ("hla2", {"decay": True}, (4, 2)),
    ("hla2", {"decay": True, "decay_convention": "d2"}, (2, 2)),
    ("hla2", {"normalize": True}, (2, 1)),
    ("ahla", {"decay": True, "normalize": True}, (4, 2)),
    ("ahla", {}, (2, 2)),
    ("hla3", {"decay": True}, (2, 2)),
    ("hla3", {"normalize": True}, (4, 2)),
])
def test_layer_equals_the_masked_definition(op, kwargs, heads):
    torch.manual_seed(0)
    config = build_config({**SMALL, "operator": op, "num_heads": heads[0], "num_kv_heads": heads[1],
                           "mixer_kwargs": kwargs})
    mixer = HLAMixer(config, 0).double()
    with torch.no_grad():  # a non-trivial norm weight and decays strong enough to matter over 9 tokens (the
        # decay is computed in fp32 like every gate: hence the tolerance of the float64 comparison)
        mixer.norm.weight.add_(0.3 * torch.randn(mixer.head_dim, dtype=torch.float64))
        if mixer.decay:
            mixer.dt_bias.add_(2.0)
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    pos = torch.arange(3, 12).unsqueeze(0).expand(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(mixer(x, pos), layer_definition(mixer, x, pos), atol=1e-6, rtol=1e-5)


# ---- the model -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
def test_forward_backward_finite_with_all_grads(op):
    model = small(op, num_kv_heads=1, mixer_kwargs={"decay": True, "conv_size": 4}).train()
    fc.check_forward_backward(model, tokens(2, 23), VOCAB, labels_only=True)
    mixer = model.model.layers[0].mixer
    assert isinstance(mixer, HLAMixer) and mixer.operator == op
    assert {"a_proj.weight", "A_log", "dt_bias", "q_conv.conv.weight"} <= dict(mixer.named_parameters()).keys()


@pytest.mark.parametrize("op, kwargs", [
    ("hla2", {"decay": True, "conv_size": 4}),
    ("hla2", {"decay": True, "decay_convention": "d2", "normalize": True}),
    ("ahla", {"decay": True, "conv_size": 3}),
    ("hla3", {"normalize": True, "conv_size": 4}),
])
def test_decoding_step_by_step_equals_full_forward(op, kwargs):
    model = small(op, seed=1, num_kv_heads=1, mixer_kwargs=kwargs)
    pieces = [(1, 6), (6, 7), (7, 8), (8, 12), (12, 13), (13, 17)]  # steps and chunks continuing the state
    cache = fc.decode_from_empty_cache(model, tokens(2, 17, seed=3), pieces)
    assert cache.get_seq_length() == 17 and cache.is_attention == [False, False]
    slot = cache[0]
    fields = {"hla2": ("S", "F"), "ahla": ("P", "E"), "hla3": ("S", "P", "F")}[op]
    assert all(slot[f].dtype == torch.float32 and slot[f].shape[:2] == (2, 2) for f in fields)
    assert ("conv_q" in slot) == ("conv_size" in kwargs)


@pytest.mark.parametrize("op", OPS)
def test_varlen_packed_equals_documents_one_by_one(op):
    model = small(op, seed=2, mixer_kwargs={"decay": True, "conv_size": 4})
    fc.check_varlen_packed(model, tokens, [5, 1, 15, 9], leak_min=1e-3, every_document=False)


@pytest.mark.parametrize("op", OPS)
def test_save_and_auto_load_round_trip(tmp_path, op):
    model = small(op, seed=4, mixer_kwargs={"decay": True, "normalize": True})
    loaded = fc.check_save_load_round_trip(model, tmp_path, tokens(2, 11, seed=5), same_parameters=False)
    assert json.loads((tmp_path / "config.json").read_text())["operator"] == op
    assert isinstance(loaded.model.layers[1].mixer, HLAMixer)
    assert loaded.config.operator == op and loaded.config.mixer_kwargs == {"decay": True, "normalize": True}


def test_configs_saved_before_the_operator_field_still_load(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = build_model(SMALL).eval()
    model.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    saved.pop("operator")
    path.write_text(json.dumps(saved))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.operator is None and isinstance(loaded.model.layers[0].mixer, AttentionMixer)
    x = tokens(1, 9)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


@pytest.mark.parametrize("op", OPS)
def test_training_steps_lower_the_loss_on_a_fixed_batch(op):
    fc.check_training_drops_loss_by(small(op, seed=5, mixer_kwargs={"decay": True}).train(), tokens(4, 32, seed=6),
                                    0.5)


@pytest.mark.parametrize("op", OPS)
def test_hybrid_keeps_softmax_attention_layers_and_decodes(op):
    model = small(op, seed=6, num_layers=3, attn_layers=[1], num_kv_heads=1, mixer_kwargs={"decay": True})
    assert [type(b.mixer) for b in model.model.layers] == [HLAMixer, AttentionMixer, HLAMixer]
    assert HiloCache.from_config(model.config).is_attention == [False, True, False]
    fc.check_generate_equals_greedy(model, tokens(1, 5, seed=7), 6)
    # the attention layer's softmax attention against its own definition, so it really is softmax attention
    x = torch.randn(1, 6, 64)
    attn = model.model.layers[1].mixer
    with torch.no_grad():
        q = attn.q_proj(x).view(1, 6, 2, 32)
        k = attn.k_proj(x).view(1, 6, 1, 32).repeat_interleave(2, 2)
        v = attn.v_proj(x).view(1, 6, 1, 32).repeat_interleave(2, 2)
        pos = torch.arange(6).unsqueeze(0)
        cos, sin = rope_cos_sin(pos, 32, attn.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        s = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(32)
        s = s.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("bhts,bshd->bthd", s.softmax(-1), v).reshape(1, 6, 64)
        torch.testing.assert_close(attn(x, pos), attn.o_proj(o), atol=1e-5, rtol=0)


def test_flops_per_token_hand_count():
    # H = 2, K = V = 32, C = 64: one pass LA(Q, K, W) costs 2C(K + W) + 4KW forward, 3x with the backward
    counts = {"hla2": 2 * (8192 + 4096), "ahla": 2 * (8192 + 4096), "hla3": 3 * (8192 + 4096)}
    for op, forward in counts.items():
        model = small(op)
        assert model.model.layers[0].mixer.flops_per_token(4096) == 3 * 2 * forward
    normalized = small("ahla", mixer_kwargs={"normalize": True}).model.layers[0].mixer
    assert normalized.flops_per_token(4096) == 3 * 2 * 2 * (2 * 64 * 65 + 4 * 32 * 33)
    conv = small("hla2", mixer_kwargs={"conv_size": 4}).model.layers[0].mixer
    assert conv.flops_per_token(16) == 3 * 2 * 2 * (2 * 16 * 64 + 4 * 32 * 32) + 3 * 6 * 4 * 64
    n_lin = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert model.num_flops_per_token(4096) == 6 * n_lin + 2 * 3 * 2 * counts["hla3"]


def test_errors_are_clear():
    with pytest.raises(ValueError, match=r"unknown operator 'hla4' for mixer 'attention'; valid operators: "
                                         r"\['softmax_attn', 'hla2', 'ahla', 'hla3'\]"):
        build_model({**SMALL, "operator": "hla4"})
    with pytest.raises(ValueError, match="d2.*hla2 with decay: true only"):
        build_model({**SMALL, "operator": "ahla", "mixer_kwargs": {"decay": True, "decay_convention": "d2"}})
    with pytest.raises(ValueError, match="d2.*hla2 with decay: true only"):
        build_model({**SMALL, "operator": "hla2", "mixer_kwargs": {"decay_convention": "d2"}})
    with pytest.raises(ValueError, match=r"unknown mixer_kwargs \['order'\] for mixer 'hla'"):
        build_model({**SMALL, "operator": "hla2", "mixer_kwargs": {"order": 2}})
    with pytest.raises(ValueError, match="set mixer=attention and operator=hla2"):
        build_model({**SMALL, "mixer": "hla"})
    with pytest.raises(ValueError, match="the attention mixer takes no mixer_kwargs"):
        build_model({**SMALL, "operator": "softmax_attn", "mixer_kwargs": {"decay": True}})
    # softmax_attn named explicitly is the default shell
    assert [type(b.mixer) for b in build_model({**SMALL, "operator": "softmax_attn"}).model.layers] == [
        AttentionMixer, AttentionMixer]


# ---- configs and the command line ----------------------------------------------------------------------------


@pytest.mark.parametrize("preset, op", [("hla_transformer", "hla2"), ("ahla_transformer", "ahla"),
                                        ("hla3_transformer", "hla3"), ("transformer", "hla3")])
def test_hydra_presets_compose_into_hla_models(preset, op):
    from omegaconf import OmegaConf

    overrides = [f"model={preset}", "model/size=tiny", "model.mixer_kwargs.decay=true", "model.attn_layers=[2]"]
    if preset == "transformer":  # the plain shell switched by the operator override alone
        overrides = [f"model={preset}", "model/size=tiny", f"model.operator={op}", "model.attn_layers=[2]"]
    cfg = fc.compose(overrides)
    assert cfg.name.startswith(f"{preset}-tiny-")
    config = build_config({**OmegaConf.to_container(cfg.model, resolve=True), "vocab_size": 1000})
    assert config.operator == op and config.mixer == "attention"
    model = HiloForCausalLM(config)
    assert [type(b.mixer) for b in model.model.layers] == [HLAMixer, HLAMixer, AttentionMixer, HLAMixer]
    assert model.model.layers[0].mixer.decay == (preset != "transformer")
    # per HLA layer: q, k, v, g projections, o_proj, the per-head norm weight (+ a_proj, A_log, dt_bias)
    c, h, d = 128, 4, 32
    hla = 5 * c * h * d + d + (c * h + 2 * h if preset != "transformer" else 0)
    attn = 4 * c * h * d
    block = 3 * c * config.intermediate_size + 2 * c
    expected = 3 * (hla + block) + (attn + block) + 2 * 1000 * c + c
    assert sum(p.numel() for p in model.parameters()) == expected


@pytest.mark.slow
def test_train_py_runs_hla_transformer(tmp_path):
    saved = json.loads(fc.run_train_py(tmp_path, ["model=hla_transformer", "model/size=tiny"], steps=4))
    assert saved["operator"] == "hla2" and saved["mixer"] == "attention"
