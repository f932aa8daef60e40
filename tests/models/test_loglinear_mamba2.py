"""models: the log-linear Mamba-2 mixer and model (CPU, fp32, small shapes).

The layer is checked against an O(T^2) float64 re-derivation written out here (Fenwick levels,
lambda = softplus(L * dl) clamped past the trained levels), and against the plain Mamba-2 layer when lambda is 1;
the model against itself across decode (past max_position_embeddings) / varlen / save-load / training.
max_position_embeddings is 16 here (5 trained levels), so sequences of 40 use clamped levels 5 and 6.
"""

import family_checks as fc
import pytest
import torch
import torch.nn.functional as F

import models.mixers.loglinear_mamba2 as loglinear_module
from models import HiloForCausalLM, build_config
from models.mixers.attention import AttentionMixer
from models.mixers.loglinear_mamba2 import LogLinearMamba2Mixer
from models.mixers.mamba2 import Mamba2Mixer

VOCAB = 89
SMALL = {"head_dim": 16, "state_size": 12, "expand": 2, "n_groups": 1}
TINY = {"vocab_size": VOCAB, "hidden_size": 48, "num_layers": 2, "num_heads": 3, "mixer": "loglinear_mamba2",
            "mixer_kwargs": SMALL, "max_position_embeddings": 16}
H, LEVELS = 6, 5  # 2 * 48 / 16 heads; bit_length(15) + 1 levels
tiny = fc.tiny_builder(TINY)
tokens = fc.token_maker(VOCAB)


def perturb(model, seed: int = 0) -> None:
    """The 1-D parameters off their init and lambda (L) spread over a wide range, so levels are told apart."""
    fc.perturb(model, seed, spread_levels=True)


def reference_loglinear_mamba2(mixer: LogLinearMamba2Mixer, hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """Log-linear Mamba-2 in float64 from the mixer's parameters: y_t = sum_{s<=t} lambda_t[min(l(t,s), Lt-1)]
    exp(G_t - G_s) (C_t.B_s) dt_s x_s + D x_t with l(t, s) = bit_length(t XOR s), then the gated norm and
    out_proj. One group (n_groups = 1)."""
    d = torch.float64
    h, p, n, lt = mixer.num_heads, mixer.head_dim, mixer.state_size, mixer.num_levels
    inner = h * p
    b, t, _ = hidden.shape
    proj = hidden.to(d) @ mixer.in_proj.weight.to(d).T
    z, xbc = proj[..., :inner], proj[..., inner:2 * inner + 2 * n]
    dt_raw, dl = proj[..., 2 * inner + 2 * n:2 * inner + 2 * n + h], proj[..., 2 * inner + 2 * n + h:]
    assert dl.shape[-1] == h * lt
    w = mixer.conv.conv.weight.to(d)[:, 0, :]
    kk = w.shape[1]
    conv = torch.zeros_like(xbc) + mixer.conv.conv.bias.to(d)
    for i in range(t):
        for j in range(kk):
            if i - (kk - 1) + j >= 0:
                conv[:, i] += w[:, j] * xbc[:, i - (kk - 1) + j]
    conv = conv * torch.sigmoid(conv)
    x = conv[..., :inner].reshape(b, t, h, p)
    bmat, cmat = conv[..., inner:inner + n], conv[..., inner + n:]
    dt = F.softplus(dt_raw + mixer.dt_bias.to(d))
    gcum = torch.cumsum(-torch.exp(mixer.A_log.to(d)) * dt, dim=1)  # [b, t, h]
    lam = F.softplus(mixer.L.to(d) * dl.reshape(b, t, h, lt))
    y = torch.zeros(b, t, h, p, dtype=d)
    for ti in range(t):
        for si in range(ti + 1):
            level = min((ti ^ si).bit_length(), lt - 1)
            weight = lam[:, ti, :, level] * torch.exp(gcum[:, ti] - gcum[:, si]) * dt[:, si]  # [b, h]
            score = (cmat[:, ti] * bmat[:, si]).sum(-1)  # [b]
            y[:, ti] += (weight * score[:, None])[..., None] * x[:, si]
    y = y + mixer.D.to(d)[:, None] * x
    y = y.reshape(b, t, inner) * F.silu(z)
    y = y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + eps) * mixer.norm.weight.to(d)
    return y @ mixer.out_proj.weight.to(d).T


def test_layer_equals_quadratic_reference_past_the_trained_levels():
    model = tiny(seed=1)
    perturb(model, seed=2)
    mixer = model.model.layers[0].mixer
    assert isinstance(mixer, LogLinearMamba2Mixer) and mixer.num_heads == H and mixer.num_levels == LEVELS
    # positions up to 39 reach levels 0..6; 5 and 6 use level 4's scale
    fc.check_layer_against_reference(model, reference_loglinear_mamba2, 40)


def test_lambda_one_equals_the_mamba2_layer(monkeypatch):
    model = tiny(seed=2)
    perturb(model, seed=3)
    mixer = model.model.layers[0].mixer
    base = Mamba2Mixer(build_config({**TINY, "mixer": "mamba2"}), 0)
    state = {k: v for k, v in mixer.state_dict().items() if k != "L"}
    state["in_proj.weight"] = state["in_proj.weight"][: base.in_proj.out_features]
    base.load_state_dict(state)
    fc.check_lambda_one_equals_base(mixer, base, loglinear_module, monkeypatch)


def test_forward_backward_finite_with_all_grads():
    model = tiny(seed=0).train()
    fc.check_forward_backward(model, tokens(2, 37), VOCAB)
    for block in model.model.layers:
        mixer = block.mixer
        assert (mixer.L.grad.abs() > 0).all()  # every (head, level) of L is reached by 37 positions
        dl_rows = mixer.in_proj.weight.grad[-H * LEVELS:]
        assert (dl_rows.abs().sum(1) > 0).all()


def test_levels_from_max_position_and_no_weight_decay():
    for positions, levels in ((1, 1), (2, 2), (16, 5), (17, 6), (2048, 12), (16384, 15)):
        config = build_config({**TINY, "max_position_embeddings": positions})
        with torch.device("meta"):
            mixer = LogLinearMamba2Mixer(config, 0)
        assert mixer.num_levels == levels and mixer.L.shape == (H, levels)
        assert mixer.in_proj.out_features == 96 + 96 + 2 * 12 + H + H * levels
    model = tiny(seed=5)
    mixer = model.model.layers[1].mixer
    assert torch.equal(mixer.L.detach(), torch.ones(H, LEVELS))
    fc.check_weight_decay_split(model, (mixer.L, mixer.A_log, mixer.dt_bias, mixer.D), (mixer.in_proj.weight,))


def test_cached_decode_equals_full_forward_and_state_grows_as_log2():
    model = tiny(seed=2)
    perturb(model, seed=4)
    t = 40  # across positions 4, 8, 16 (the trained maximum) and 32
    pieces = [(3, 4), (4, 5), (5, 12)] + [(i, i + 1) for i in range(12, t)]  # a chunk continues the state
    cache, levels = fc.decode_in_pieces(model, tokens(2, t, seed=3), 3, pieces,
                                        on_step=lambda cache: cache[0]["recurrent_levels"].shape[2])
    consumed = [3, 4, 5] + list(range(12, t + 1))
    assert levels == [(n - 1).bit_length() + 1 for n in consumed]  # 2 levels at 3 tokens ... 7 at 40
    slot = cache[1]
    assert slot["recurrent_levels"].shape == (2, H, 7, 12, 16) and slot["recurrent_levels"].dtype == torch.float32
    assert slot["recurrent_tokens"].tolist() == [t, t] and slot["conv_state"].shape == (2, 96 + 2 * 12, 3)
    assert "recurrent_state" not in slot


def test_generate_past_max_position_equals_greedy():
    model = tiny(seed=3)
    perturb(model, seed=5)
    fc.check_generate_equals_greedy(model, tokens(1, 5, seed=6), 16)  # to position 20


def test_varlen_packed_equals_documents_one_by_one():
    model = tiny(seed=4)
    perturb(model, seed=5)
    # 19 goes past the trained 16 positions; 1 and 2 are shorter than the conv
    fc.check_varlen_packed(model, tokens, [5, 1, 19, 2, 9])


def test_hybrid_with_attention_layers_decodes_and_packs():
    model = tiny(seed=5, num_layers=3, attn_layers=[1])
    assert [type(b.mixer) for b in model.model.layers] == [LogLinearMamba2Mixer, AttentionMixer, LogLinearMamba2Mixer]
    cache = fc.check_hybrid_decodes_and_packs(model, tokens(1, 20, seed=7))
    assert cache[1]["key"].shape[1] == 20 and "recurrent_levels" in cache[2] and "key" not in cache[0]


def test_save_and_auto_load_round_trip(tmp_path):
    model = tiny(seed=6)
    perturb(model, seed=7)
    loaded = fc.check_save_load_round_trip(model, tmp_path, tokens(2, 20, seed=8), mixer="loglinear_mamba2")
    assert isinstance(loaded.model.layers[0].mixer, LogLinearMamba2Mixer)
    assert not torch.equal(loaded.model.layers[0].mixer.L, torch.ones(H, LEVELS))
    assert getattr(loaded.model.layers[0].mixer.L, "_no_weight_decay", False)


def test_training_steps_on_a_fixed_batch_lower_the_loss():
    model = tiny(seed=7).train()
    start = model.model.layers[0].mixer.L.detach().clone()
    fc.check_training_lowers_loss(model, tokens(4, 32, seed=9))
    assert not torch.equal(model.model.layers[0].mixer.L.detach(), start)


def test_flops_per_token_hand_count():
    model = tiny()
    mixer = model.model.layers[0].mixer
    k, v, conv = 12, 16, 96 + 2 * 12
    # (seq_len, chunk, chunk-level passes): 100 needs levels 0..7 (one pass), 4096 levels 0..12 (six)
    for t, c, j in ((1, 1, 0), (40, 40, 0), (64, 64, 0), (65, 64, 1), (100, 64, 1), (4096, 64, 6)):
        assert mixer.flops_per_token(t) == 3 * H * (2 * c * (k + v) + 2 * k * v * (1 + j)) + 6 * 4 * conv
    fc.check_model_flops(model, mixer)


def test_hydra_compose_loglinear_mamba2_760m_and_tiny():
    from omegaconf import OmegaConf

    cfg = fc.compose(["model=loglinear_mamba2", "model/size=760m", "model.max_position_embeddings=16384"])
    assert cfg.name.startswith("loglinear_mamba2-760m-")
    config = build_config({**OmegaConf.to_container(cfg.model, resolve=True), "vocab_size": 1000})
    assert config.mixer == "loglinear_mamba2" and config.hidden_size == 1536 and config.num_layers == 21
    with torch.device("meta"):
        model = HiloForCausalLM(config)
    mixer = model.model.layers[0].mixer
    assert isinstance(mixer, LogLinearMamba2Mixer) and mixer.num_heads == 48 and mixer.num_levels == 15
    tiny_cfg = fc.compose(["model=loglinear_mamba2", "model/size=tiny", "model.attn_layers=[1]"])
    config = build_config({**OmegaConf.to_container(tiny_cfg.model, resolve=True), "vocab_size": 100})
    assert config.hidden_size == 128 and config.attn_layers == [1] and config.max_position_embeddings == 1024


@pytest.mark.parametrize("size", ["tiny", "125m", "340m", "760m", "1.3b"])
def test_size_presets_build_with_the_analytic_parameter_count(size):
    config, model = fc.preset_model("loglinear_mamba2", size)
    c, inner, n = config.hidden_size, 2 * config.hidden_size, 128
    h, conv_dim = inner // 64, inner + 2 * n
    levels = (config.max_position_embeddings - 1).bit_length() + 1  # 11 at tiny (1024), else 12 (2048)
    mixer = (c * (inner + conv_dim + h + h * levels) + conv_dim * 4 + conv_dim  # in_proj (dl too), conv
             + 3 * h + h * levels + inner + inner * c)                         # A_log, dt_bias, D, L, norm, out_proj
    fc.check_parameter_count(model, config, mixer)


@pytest.mark.slow
def test_train_py_runs_loglinear_mamba2(tmp_path):
    config = fc.run_train_py(tmp_path, ["model=loglinear_mamba2", "model/size=tiny"], steps=4, seq_len=96)
    assert "loglinear_mamba2" in config
