"""models: the Gated DeltaNet mixer and model (CPU, fp32, small shapes).

The layer is checked against a token-by-token float64 re-derivation of the gated_deltanet shell written
out here (not the module's code path); the model against itself across decode / varlen / save-load / training.
"""


import family_checks as fc
import pytest
import torch
import torch.nn.functional as F
from family_checks import causal_conv_silu, perturb

from models import HiloForCausalLM, build_config
from models.mixers.attention import AttentionMixer
from models.mixers.gated_deltanet import GatedDeltaNetMixer

VOCAB = 89
SMALL = {"head_dim": 16, "num_heads": 3, "expand_v": 2}
TINY = {"vocab_size": VOCAB, "hidden_size": 48, "num_layers": 2, "num_heads": 3, "mixer": "gated_deltanet",
        "mixer_kwargs": SMALL}
tiny = fc.tiny_builder(TINY)
tokens = fc.token_maker(VOCAB)


def reference_gdn(mixer: GatedDeltaNetMixer, hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """The gated_deltanet shell, one token at a time, float64, from the mixer's parameters."""
    d = torch.float64
    h, dk, dv = mixer.num_heads, mixer.head_dim, mixer.head_v_dim
    b, t, _ = hidden.shape
    x = hidden.to(d)

    def lin(layer):
        return x @ layer.weight.to(d).T

    q = causal_conv_silu(lin(mixer.q_proj), mixer.q_conv.conv).reshape(b, t, h, dk)
    k = causal_conv_silu(lin(mixer.k_proj), mixer.k_conv.conv).reshape(b, t, h, dk)
    v = causal_conv_silu(lin(mixer.v_proj), mixer.v_conv.conv).reshape(b, t, h, dv)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    beta = torch.sigmoid(lin(mixer.b_proj))
    g = -torch.exp(mixer.A_log.to(d)) * F.softplus(lin(mixer.a_proj) + mixer.dt_bias.to(d))
    o = torch.zeros(b, t, h, dv, dtype=d)
    for bi in range(b):
        for hi in range(h):
            s = torch.zeros(dk, dv, dtype=d)
            for i in range(t):
                kt, bt = k[bi, i, hi], beta[bi, i, hi]
                s = torch.exp(g[bi, i, hi]) * (s - bt * torch.outer(kt, kt @ s)) + bt * torch.outer(kt, v[bi, i, hi])
                o[bi, i, hi] = dk ** -0.5 * q[bi, i, hi] @ s
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + eps) * mixer.norm.weight.to(d)
    o = o * F.silu(lin(mixer.g_proj).reshape(b, t, h, dv))
    return o.reshape(b, t, h * dv) @ mixer.o_proj.weight.to(d).T


@pytest.mark.parametrize("kwargs, t", [(SMALL, 9), ({"head_dim": 144, "num_heads": 1, "expand_v": 4}, 5)])
def test_layer_equals_token_by_token_reference(kwargs, t):
    # the second case has value heads of 576 columns: the mixer runs the operator on column blocks (256, 256, 64)
    model = tiny(seed=1, mixer_kwargs=kwargs)
    perturb(model, seed=2)
    mixer = model.model.layers[0].mixer
    assert mixer.head_v_dim == kwargs["expand_v"] * kwargs["head_dim"]
    fc.check_layer_against_reference(model, reference_gdn, t)


def test_default_head_count_follows_hidden_size():
    shapes = {}
    for hidden in (2048, 1024, 128):
        config = build_config({"vocab_size": 10, "hidden_size": hidden, "num_layers": 1, "num_heads": 16,
                               "mixer": "gated_deltanet"})
        with torch.device("meta"):
            mixer = GatedDeltaNetMixer(config, 0)
        shapes[hidden] = (mixer.num_heads, mixer.head_dim, mixer.head_v_dim)
    assert shapes == {2048: (6, 256, 512), 1024: (3, 256, 512), 128: (1, 256, 512)}


def test_forward_backward_finite_with_all_grads():
    fc.check_forward_backward(tiny(seed=0).train(), tokens(2, 37), VOCAB)


def test_init_ranges_and_no_weight_decay_flags():
    model = tiny(seed=5, mixer_kwargs={"head_dim": 4, "num_heads": 128})
    mixer = model.model.layers[1].mixer
    fc.check_decay_init(mixer, 128)
    assert torch.equal(mixer.norm.weight.detach(), torch.ones(8))
    fc.check_weight_decay_split(model, (mixer.A_log, mixer.dt_bias), (mixer.q_proj.weight,), flagged=True)
    fc.check_projection_init_std(model, mixer.v_proj.weight, mixer.o_proj.weight)


def test_cached_decode_equals_full_forward():
    model = tiny(seed=2)
    perturb(model, seed=4)
    x = tokens(2, 23, seed=3)
    # a one-token prompt: decoding starts from an empty state
    pieces = [(1, 2), (2, 3), (3, 9), (9, 10)] + [(i, i + 1) for i in range(10, 23)]
    cache, _ = fc.decode_in_pieces(model, x, 1, pieces)
    slot = cache[1]
    assert slot["conv_q"].shape == (2, 48, 3) and slot["conv_v"].shape == (2, 96, 3)
    assert slot["recurrent_state"].shape == (2, 3, 16, 32) and slot["recurrent_state"].dtype == torch.float32


def test_cached_decode_with_wide_value_heads():
    # V = 576: the prefill runs the operator in column blocks, the decode step over all columns at once
    model = tiny(seed=3, mixer_kwargs={"head_dim": 144, "num_heads": 1, "expand_v": 4})
    cache, _ = fc.decode_in_pieces(model, tokens(1, 9, seed=4), 4, [(i, i + 1) for i in range(4, 9)])
    assert cache[0]["recurrent_state"].shape == (1, 1, 144, 576)


@pytest.mark.parametrize("head_dim, expand_v, value_block, widths",
                         [(256, 2, None, [512]), (256, 2, 256, [256, 256]), (144, 4, 512, [512, 64]), (144, 4, 100, [100] * 5 + [76])])
def test_operator_calls_per_value_block(monkeypatch, head_dim, expand_v, value_block, widths):
    """delta_rule takes V up to 512: mixer_kwargs.value_block (default None: 512) sets the columns per call, so the
    default K = 256, V = 512 heads run in one call, with or without a cache, and value_block=256 in two."""
    import models.mixers.gated_deltanet as gdn_module

    fc.check_operator_calls_per_value_block(tiny, tokens, gdn_module, "delta_rule", monkeypatch,
                                            {"head_dim": head_dim, "num_heads": 1, "expand_v": expand_v},
                                            value_block, widths)


def test_generate_feeds_one_token_per_step_and_equals_greedy():
    fc.check_generate_equals_greedy(tiny(seed=3), tokens(1, 5, seed=6), 6, one_token_per_step=True)


def test_varlen_packed_equals_documents_one_by_one():
    model = tiny(seed=4)
    perturb(model, seed=5)
    fc.check_varlen_packed(model, tokens, [5, 1, 15, 2, 9])


def test_hybrid_with_attention_layers_decodes_and_packs():
    model = tiny(seed=5, num_layers=3, attn_layers=[0, 2])
    assert [type(b.mixer) for b in model.model.layers] == [AttentionMixer, GatedDeltaNetMixer, AttentionMixer]
    cache = fc.check_hybrid_decodes_and_packs(model, tokens(1, 14, seed=7))
    assert cache[0]["key"].shape[1] == 14 and "recurrent_state" in cache[1]


def test_save_and_auto_load_round_trip(tmp_path):
    model = tiny(seed=6, mixer_kwargs={"head_dim": 8, "num_heads": 2, "expand_v": 1, "conv_size": 3})
    perturb(model, seed=7)
    loaded = fc.check_save_load_round_trip(model, tmp_path, tokens(2, 16, seed=8), mixer="gated_deltanet")
    mixer = loaded.model.layers[0].mixer
    assert (mixer.num_heads, mixer.head_v_dim, mixer.q_conv.kernel_size) == (2, 8, 3)


def test_training_steps_on_a_fixed_batch_lower_the_loss():
    fc.check_training_lowers_loss(tiny(seed=7).train(), tokens(4, 32, seed=9))


def test_flops_per_token_hand_count():
    model = tiny()
    mixer = model.model.layers[0].mixer
    h, k, v = 3, 16, 32
    for t, c in ((1, 1), (40, 40), (4096, 64)):
        expected = 3 * h * (6 * c * k + 4 * c * v + 6 * k * v + c * c) + 6 * 4 * (2 * h * k + h * v)
        assert mixer.flops_per_token(t) == expected
    fc.check_model_flops(model, mixer)


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match=r"unknown mixer_kwargs \['heads'\].*valid keys.*num_heads"):
        tiny(mixer_kwargs={"heads": 4})
    with pytest.raises(ValueError, match="head_dim must be <= 256"):
        tiny(mixer_kwargs={"head_dim": 320})
    with pytest.raises(ValueError, match=r"gated_deltanet value_block must be in 1\.\.512.*got 513"):
        tiny(mixer_kwargs={"value_block": 513})
    with pytest.raises(ValueError, match=r"value_block must be in 1\.\.512.*got 0"):
        tiny(mixer_kwargs={"value_block": 0})


def test_hydra_compose_gated_deltanet_with_sizes_and_overrides():
    from omegaconf import OmegaConf

    cfg = fc.compose(["model=gated_deltanet", "model/size=1.3b"])
    assert cfg.name.startswith("gated_deltanet-1.3b-")
    config = build_config({**OmegaConf.to_container(cfg.model, resolve=True), "vocab_size": 1000})
    with torch.device("meta"):
        model = HiloForCausalLM(config)
    mixer = model.model.layers[0].mixer
    assert isinstance(mixer, GatedDeltaNetMixer) and config.num_layers == 24
    assert (mixer.num_heads, mixer.head_dim, mixer.head_v_dim) == (6, 256, 512)
    cfg = fc.compose(["model=gated_deltanet", "model/size=tiny", "model.mixer_kwargs.head_dim=32",
                    "model.mixer_kwargs.num_heads=4", "model.attn_layers=[3]"])
    config = build_config({**OmegaConf.to_container(cfg.model, resolve=True), "vocab_size": 100})
    model = HiloForCausalLM(config)
    mixer = model.model.layers[0].mixer
    assert (mixer.num_heads, mixer.head_dim, mixer.head_v_dim) == (4, 32, 64)
    assert isinstance(model.model.layers[3].mixer, AttentionMixer)


@pytest.mark.slow
def test_train_py_runs_gated_deltanet(tmp_path):
    assert "gated_deltanet" in fc.run_train_py(tmp_path, ["model=gated_deltanet", "model/size=tiny"], steps=4)


@pytest.mark.parametrize("size", ["tiny", "125m", "340m", "760m", "1.3b"])
def test_size_presets_build_with_the_analytic_parameter_count(size):
    config, model = fc.preset_model("gated_deltanet", size)
    c = config.hidden_size
    h = {128: 1, 768: 2, 1024: 3, 1536: 5, 2048: 6}[c]
    k, v = 256, 512
    mixer = (c * h * (2 * k + 2 * v + 2)    # q, k, v, g, a, b projections
             + 4 * h * (2 * k + v)          # the three convs (no bias)
             + 2 * h + v + h * v * c)       # A_log, dt_bias, per-head norm weight, o_proj
    fc.check_parameter_count(model, config, mixer)
    assert model.model.layers[0].mixer.num_heads == h
