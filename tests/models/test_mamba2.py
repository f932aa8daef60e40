"""models: the Mamba-2 mixer and model (CPU, fp32, small shapes).

The layer is checked against a token-by-token float64 re-derivation of the mamba2 shell written out here
(not the module's code path); the model against itself across decode / varlen / save-load / training.
"""


import family_checks as fc
import pytest
import torch
import torch.nn.functional as F
from family_checks import perturb

from models import HiloForCausalLM, build_config
from models.mixers.attention import AttentionMixer
from models.mixers.mamba2 import Mamba2Mixer

VOCAB = 89
SMALL = {"head_dim": 16, "state_size": 12, "expand": 2, "n_groups": 1}
TINY = {"vocab_size": VOCAB, "hidden_size": 48, "num_layers": 2, "num_heads": 3, "mixer": "mamba2",
        "mixer_kwargs": SMALL}
tiny = fc.tiny_builder(TINY)
tokens = fc.token_maker(VOCAB)


def reference_mamba2(mixer: Mamba2Mixer, hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """The mamba2 shell, one token at a time, float64, from the mixer's parameters."""
    d = torch.float64
    h, p, n, grp = mixer.num_heads, mixer.head_dim, mixer.state_size, mixer.n_groups
    inner = h * p
    b, t, _ = hidden.shape
    proj = hidden.to(d) @ mixer.in_proj.weight.to(d).T
    z, xbc, dt_raw = proj[..., :inner], proj[..., inner:inner + inner + 2 * grp * n], proj[..., -h:]
    w = mixer.conv.conv.weight.to(d)[:, 0, :]  # [channels, K]; w[:, K-1] multiplies the current token
    kk = w.shape[1]
    conv = torch.zeros_like(xbc) + (mixer.conv.conv.bias.to(d) if mixer.conv.conv.bias is not None else 0)
    for i in range(t):
        for j in range(kk):
            src = i - (kk - 1) + j
            if src >= 0:
                conv[:, i] += w[:, j] * xbc[:, src]
    conv = conv * torch.sigmoid(conv)
    x = conv[..., :inner].reshape(b, t, h, p)
    bmat = conv[..., inner:inner + grp * n].reshape(b, t, grp, n)
    cmat = conv[..., inner + grp * n:].reshape(b, t, grp, n)
    dt = F.softplus(dt_raw + mixer.dt_bias.to(d))
    a = -torch.exp(mixer.A_log.to(d))
    y = torch.zeros(b, t, h, p, dtype=d)
    for bi in range(b):
        for hi in range(h):
            gi = hi // (h // grp)
            s = torch.zeros(n, p, dtype=d)
            for i in range(t):
                s = torch.exp(a[hi] * dt[bi, i, hi]) * s + torch.outer(bmat[bi, i, gi], dt[bi, i, hi] * x[bi, i, hi])
                y[bi, i, hi] = cmat[bi, i, gi] @ s + mixer.D.to(d)[hi] * x[bi, i, hi]
    y = y.reshape(b, t, inner) * F.silu(z)
    y = y.reshape(b, t, grp, inner // grp)
    y = (y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + eps)).reshape(b, t, inner) * mixer.norm.weight.to(d)
    return y @ mixer.out_proj.weight.to(d).T


@pytest.mark.parametrize("n_groups, t", [(1, 11), (2, 7)])
def test_layer_equals_token_by_token_reference(n_groups, t):
    model = tiny(seed=1, mixer_kwargs={**SMALL, "n_groups": n_groups})
    perturb(model, seed=2)
    mixer = model.model.layers[0].mixer
    assert mixer.num_heads == 6 and mixer.n_groups == n_groups
    fc.check_layer_against_reference(model, reference_mamba2, t)


def test_forward_backward_finite_with_all_grads():
    fc.check_forward_backward(tiny(seed=0).train(), tokens(2, 37), VOCAB)


def test_init_ranges_and_no_weight_decay_flags():
    model = tiny(seed=5, hidden_size=256, num_heads=4, mixer_kwargs={"head_dim": 4, "state_size": 4})  # 128 heads per layer
    mixer = model.model.layers[1].mixer
    fc.check_decay_init(mixer, 128)
    assert torch.equal(mixer.D.detach(), torch.ones(128))
    assert torch.equal(mixer.norm.weight.detach(), torch.ones(512))
    fc.check_weight_decay_split(model, (mixer.A_log, mixer.dt_bias, mixer.D), (mixer.in_proj.weight,), flagged=True)
    fc.check_projection_init_std(model, mixer.in_proj.weight, mixer.out_proj.weight)


def test_cached_decode_equals_full_forward():
    model = tiny(seed=2)
    perturb(model, seed=4)
    x = tokens(2, 23, seed=3)
    # a prompt shorter than the conv window
    pieces = [(2, 3), (3, 4), (4, 9), (9, 10)] + [(i, i + 1) for i in range(10, 23)]
    cache, _ = fc.decode_in_pieces(model, x, 2, pieces)
    slot = cache[0]
    assert slot["conv_state"].shape == (2, 96 + 2 * 12, 3)
    assert slot["recurrent_state"].shape == (2, 6, 12, 16) and slot["recurrent_state"].dtype == torch.float32


def test_generate_feeds_one_token_per_step_and_equals_greedy():
    fc.check_generate_equals_greedy(tiny(seed=3), tokens(1, 5, seed=6), 6, one_token_per_step=True)


def test_varlen_packed_equals_documents_one_by_one():
    model = tiny(seed=4)
    perturb(model, seed=5)
    # lengths 1 and 2 are shorter than the conv window; without cu_seqlens the conv and the state leak across
    # documents: every later document changes
    fc.check_varlen_packed(model, tokens, [5, 1, 15, 2, 9])


def test_hybrid_with_attention_layers_decodes_and_packs():
    model = tiny(seed=5, num_layers=3, attn_layers=[1])
    assert [type(b.mixer) for b in model.model.layers] == [Mamba2Mixer, AttentionMixer, Mamba2Mixer]
    assert model.model.layers[1].mixer.head_dim == 16  # attention: hidden_size / num_heads
    cache = fc.check_hybrid_decodes_and_packs(model, tokens(1, 14, seed=7))
    assert cache[1]["key"].shape[1] == 14 and "recurrent_state" in cache[0] and "key" not in cache[0]


def test_save_and_auto_load_round_trip(tmp_path):
    model = tiny(seed=6, mixer_kwargs={**SMALL, "n_groups": 2, "state_size": 8})
    perturb(model, seed=7)
    loaded = fc.check_save_load_round_trip(model, tmp_path, tokens(2, 16, seed=8), mixer="mamba2")
    assert loaded.config.mixer_kwargs["n_groups"] == 2 and loaded.model.layers[0].mixer.state_size == 8


def test_training_steps_on_a_fixed_batch_lower_the_loss():
    fc.check_training_lowers_loss(tiny(seed=7).train(), tokens(4, 32, seed=9))


def test_flops_per_token_hand_count():
    model = tiny()
    mixer = model.model.layers[0].mixer
    h, k, v, conv = 6, 12, 16, 96 + 2 * 12
    for t, c in ((1, 1), (40, 40), (4096, 64)):
        assert mixer.flops_per_token(t) == 3 * h * (2 * c * (k + v) + 4 * k * v) + 6 * 4 * conv
    fc.check_model_flops(model, mixer)


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match=r"unknown mixer_kwargs \['state'\].*valid keys.*state_size"):
        tiny(mixer_kwargs={"state": 4})
    with pytest.raises(ValueError, match="multiple of head_dim"):
        tiny(mixer_kwargs={"head_dim": 10})
    with pytest.raises(ValueError, match="n_groups"):
        tiny(mixer_kwargs={**SMALL, "n_groups": 4})


def test_hydra_compose_mamba2_with_sizes_and_overrides():
    from omegaconf import OmegaConf

    cfg = fc.compose(["model=mamba2", "model/size=340m", "model.mixer_kwargs.state_size=64"])
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    assert cfg.name.startswith("mamba2-340m-")
    config = build_config({**model_cfg, "vocab_size": 1000})
    assert config.mixer == "mamba2" and config.hidden_size == 1024 and config.num_layers == 24
    assert config.mixer_kwargs["state_size"] == 64 and config.mixer_kwargs["head_dim"] == 64
    with torch.device("meta"):
        model = HiloForCausalLM(config)
    mixer = model.model.layers[0].mixer
    assert isinstance(mixer, Mamba2Mixer) and mixer.num_heads == 2 * 1024 // 64 and mixer.state_size == 64
    tiny_cfg = fc.compose(["model=mamba2", "model/size=tiny", "model.attn_layers=[1]"])
    config = build_config({**OmegaConf.to_container(tiny_cfg.model, resolve=True), "vocab_size": 100})
    assert config.hidden_size == 128 and config.attn_layers == [1]


@pytest.mark.slow
def test_train_py_runs_mamba2(tmp_path):
    assert "mamba2" in fc.run_train_py(tmp_path, ["model=mamba2", "model/size=tiny"], steps=4)


@pytest.mark.parametrize("size", ["tiny", "125m", "340m", "760m", "1.3b"])
def test_size_presets_build_with_the_analytic_parameter_count(size):
    config, model = fc.preset_model("mamba2", size)
    c, inner, n = config.hidden_size, 2 * config.hidden_size, 128
    h, conv_dim = inner // 64, inner + 2 * n
    mixer = (c * (inner + conv_dim + h) + conv_dim * 4 + conv_dim  # in_proj, conv weight and bias
             + 3 * h + inner + inner * c)                           # A_log, dt_bias, D, gated norm, out_proj
    fc.check_parameter_count(model, config, mixer)
    assert model.model.layers[0].mixer.num_heads == h
