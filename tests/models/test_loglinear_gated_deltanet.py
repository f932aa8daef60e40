"""models: the log-linear Gated DeltaNet mixer and model (CPU, fp32, small shapes).

The layer is checked against an O(T^2) float64 re-derivation written out here (Fenwick levels,
the delta rule's transition products, lambda = softplus(L * dl) clamped past the trained levels), and against the
plain Gated DeltaNet layer when lambda is 1; the model against itself across decode (past
max_position_embeddings) / varlen / save-load / training. max_position_embeddings is 16 here (5 trained levels).
"""

import family_checks as fc
import pytest
import torch
import torch.nn.functional as F
from family_checks import causal_conv_silu

import models.mixers.loglinear_gated_deltanet as loglinear_module
from models import HiloForCausalLM, build_config
from models.mixers.attention import AttentionMixer
from models.mixers.gated_deltanet import GatedDeltaNetMixer
from models.mixers.loglinear_gated_deltanet import LogLinearGatedDeltaNetMixer

VOCAB = 89
SMALL = {"head_dim": 16, "num_heads": 3, "expand_v": 2}
WIDE = {"head_dim": 144, "num_heads": 1, "expand_v": 4}  # value heads of 576: run in column blocks (256, 256, 64)
TINY = {"vocab_size": VOCAB, "hidden_size": 48, "num_layers": 2, "num_heads": 3, "mixer": "loglinear_gated_deltanet",
            "mixer_kwargs": SMALL, "max_position_embeddings": 16}
H, LEVELS = 3, 5
tiny = fc.tiny_builder(TINY)
tokens = fc.token_maker(VOCAB)


def perturb(model, seed: int = 0) -> None:
    """The 1-D parameters off their init and lambda (L) spread over a wide range, so levels are told apart."""
    fc.perturb(model, seed, spread_levels=True)


def reference_loglinear_gdn(mixer: LogLinearGatedDeltaNetMixer, hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """In float64: o_t = K^-1/2 sum_{s<=t} lambda_t[min(l(t,s), Lt-1)] q_t^T P_{t<-s} beta_s k_s v_s^T
    with P_{t<-s} = prod_{r=s+1..t} exp(g_r)(I - beta_r k_r k_r^T): the row q_t^T P_{t<-s} is walked from s = t
    down to 0, one transition at a time; then the gated per-head norm and o_proj."""
    d = torch.float64
    h, dk, dv, lt = mixer.num_heads, mixer.head_dim, mixer.head_v_dim, mixer.num_levels
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
    lam = F.softplus(mixer.L.to(d) * lin(mixer.l_proj).reshape(b, t, h, lt))
    o = torch.zeros(b, t, h, dv, dtype=d)
    for ti in range(t):
        u = q[:, ti].clone()  # [b, h, K]: q_t^T P_{t<-s}, starting at s = t
        for si in range(ti, -1, -1):
            weight = lam[:, ti, :, min((ti ^ si).bit_length(), lt - 1)] * beta[:, si] * (u * k[:, si]).sum(-1)
            o[:, ti] += weight[..., None] * v[:, si]
            u = torch.exp(g[:, si])[..., None] * (u - beta[:, si, :, None] * (u * k[:, si]).sum(-1, keepdim=True)
                                                  * k[:, si])
    o = dk ** -0.5 * o
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + eps) * mixer.norm.weight.to(d)
    o = o * F.silu(lin(mixer.g_proj).reshape(b, t, h, dv))
    return o.reshape(b, t, h * dv) @ mixer.o_proj.weight.to(d).T


@pytest.mark.parametrize("kwargs, t", [(SMALL, 40), (WIDE, 21)])
def test_layer_equals_quadratic_reference_past_the_trained_levels(kwargs, t):
    model = tiny(seed=1, mixer_kwargs=kwargs)
    perturb(model, seed=2)
    mixer = model.model.layers[0].mixer
    assert isinstance(mixer, LogLinearGatedDeltaNetMixer) and mixer.num_levels == LEVELS
    fc.check_layer_against_reference(model, reference_loglinear_gdn, t)


def test_lambda_one_equals_the_gated_deltanet_layer(monkeypatch):
    model = tiny(seed=2)
    perturb(model, seed=3)
    mixer = model.model.layers[0].mixer
    base = GatedDeltaNetMixer(build_config({**TINY, "mixer": "gated_deltanet"}), 0)
    base.load_state_dict({k: v for k, v in mixer.state_dict().items() if k not in ("L", "l_proj.weight")})
    fc.check_lambda_one_equals_base(mixer, base, loglinear_module, monkeypatch)


def test_forward_backward_finite_with_all_grads():
    model = tiny(seed=0).train()
    fc.check_forward_backward(model, tokens(2, 37), VOCAB)
    for block in model.model.layers:
        assert (block.mixer.L.grad.abs() > 0).all()  # every (head, level) of L is reached by 37 positions
        assert (block.mixer.l_proj.weight.grad.abs().sum(1) > 0).all()


def test_levels_from_max_position_and_no_weight_decay():
    for positions, levels in ((1, 1), (16, 5), (17, 6), (2048, 12), (16384, 15)):
        config = build_config({**TINY, "max_position_embeddings": positions})
        with torch.device("meta"):
            mixer = LogLinearGatedDeltaNetMixer(config, 0)
        assert mixer.num_levels == levels and mixer.L.shape == (H, levels)
        assert mixer.l_proj.weight.shape == (H * levels, 48)
    model = tiny(seed=5)
    mixer = model.model.layers[1].mixer
    assert torch.equal(mixer.L.detach(), torch.ones(H, LEVELS))
    fc.check_weight_decay_split(model, (mixer.L, mixer.A_log, mixer.dt_bias), (mixer.l_proj.weight,))


@pytest.mark.parametrize("kwargs, t", [(SMALL, 40), (WIDE, 18)])
def test_cached_decode_equals_full_forward_and_state_grows_as_log2(kwargs, t):
    model = tiny(seed=2, mixer_kwargs=kwargs)
    perturb(model, seed=4)
    # a one-token prompt: decoding starts from an empty state; a chunk continues the state
    pieces = [(1, 2), (2, 3), (3, 11)] + [(i, i + 1) for i in range(11, t)]
    cache, levels = fc.decode_in_pieces(model, tokens(2, t, seed=3), 1, pieces,
                                        on_step=lambda cache: cache[0]["recurrent_levels"].shape[2])
    consumed = [1, 2, 3] + list(range(11, t + 1))
    assert levels == [(n - 1).bit_length() + 1 for n in consumed]  # 1 level at 1 token ... 7 at 40
    mixer, slot = model.model.layers[1].mixer, cache[1]
    shape = (2, mixer.num_heads, (t - 1).bit_length() + 1, mixer.head_dim, mixer.head_v_dim)
    assert slot["recurrent_levels"].shape == shape and slot["recurrent_levels"].dtype == torch.float32
    assert slot["recurrent_tokens"].tolist() == [t, t] and "recurrent_state" not in slot


@pytest.mark.parametrize("head_dim, expand_v, value_block, widths",
                         [(256, 2, None, [512]), (256, 2, 256, [256, 256]), (144, 4, 512, [512, 64])])
def test_operator_calls_per_value_block(monkeypatch, head_dim, expand_v, value_block, widths):
    """loglinear_delta_rule takes V up to 512: mixer_kwargs.value_block (default None: 512) sets the columns per
    call, so the default K = 256, V = 512 heads run in one call, with or without a cache, and value_block=256 in
    two."""
    fc.check_operator_calls_per_value_block(tiny, tokens, loglinear_module, "loglinear_delta_rule", monkeypatch,
                                            {"head_dim": head_dim, "num_heads": 1, "expand_v": expand_v},
                                            value_block, widths)


def test_generate_past_max_position_equals_greedy():
    model = tiny(seed=3)
    perturb(model, seed=5)
    fc.check_generate_equals_greedy(model, tokens(1, 5, seed=6), 12)  # to position 16


def test_varlen_packed_equals_documents_one_by_one():
    model = tiny(seed=4)
    perturb(model, seed=5)
    fc.check_varlen_packed(model, tokens, [5, 1, 19, 2, 9])  # 19 goes past the trained 16 positions


def test_hybrid_with_attention_layers_decodes_and_packs():
    model = tiny(seed=5, num_layers=3, attn_layers=[1])
    assert [type(b.mixer) for b in model.model.layers] == [
        LogLinearGatedDeltaNetMixer, AttentionMixer, LogLinearGatedDeltaNetMixer]
    cache = fc.check_hybrid_decodes_and_packs(model, tokens(1, 20, seed=7))
    assert cache[1]["key"].shape[1] == 20 and "recurrent_levels" in cache[2] and "key" not in cache[0]


def test_save_and_auto_load_round_trip(tmp_path):
    model = tiny(seed=6, mixer_kwargs={"head_dim": 8, "num_heads": 2, "expand_v": 1, "conv_size": 3})
    perturb(model, seed=7)
    loaded = fc.check_save_load_round_trip(model, tmp_path, tokens(2, 20, seed=8), mixer="loglinear_gated_deltanet")
    mixer = loaded.model.layers[0].mixer
    assert isinstance(mixer, LogLinearGatedDeltaNetMixer) and mixer.L.shape == (2, LEVELS)
    assert getattr(mixer.L, "_no_weight_decay", False)  # the loaded parameter is flagged too


def test_training_steps_on_a_fixed_batch_lower_the_loss():
    model = tiny(seed=7).train()
    start = model.model.layers[0].mixer.L.detach().clone()
    fc.check_training_lowers_loss(model, tokens(4, 32, seed=9))
    assert not torch.equal(model.model.layers[0].mixer.L.detach(), start)


def test_flops_per_token_hand_count():
    model = tiny()
    mixer = model.model.layers[0].mixer
    k, v = 16, 32
    conv = 6 * 4 * (2 * H * k + H * v)
    for t, c, j in ((1, 1, 0), (40, 40, 0), (64, 64, 0), (65, 64, 1), (100, 64, 1), (4096, 64, 6)):
        forward = (10 * c * k + 3 * c * c + 2 * c * v + 2 * k * k + 2 * k * v
                   + j * (2 * k * v + 2 * k * k * v / c))
        assert mixer.flops_per_token(t) == pytest.approx(3 * H * forward + conv, rel=1e-12)
    fc.check_model_flops(model, mixer)


def test_hydra_compose_loglinear_gated_deltanet_760m_and_tiny():
    from omegaconf import OmegaConf

    cfg = fc.compose(["model=loglinear_gated_deltanet", "model/size=760m"])
    assert cfg.name.startswith("loglinear_gated_deltanet-760m-")
    config = build_config({**OmegaConf.to_container(cfg.model, resolve=True), "vocab_size": 1000})
    assert config.hidden_size == 1536 and config.num_layers == 21 and config.max_position_embeddings == 2048
    with torch.device("meta"):
        model = HiloForCausalLM(config)
    mixer = model.model.layers[0].mixer
    assert isinstance(mixer, LogLinearGatedDeltaNetMixer) and mixer.num_levels == 12
    assert (mixer.num_heads, mixer.head_dim, mixer.head_v_dim) == (5, 256, 512)
    cfg = fc.compose(["model=loglinear_gated_deltanet", "model/size=tiny", "model.mixer_kwargs.head_dim=32",
                    "model.mixer_kwargs.num_heads=4", "model.attn_layers=[3]"])
    config = build_config({**OmegaConf.to_container(cfg.model, resolve=True), "vocab_size": 100})
    with torch.device("meta"):
        model = HiloForCausalLM(config)
    mixer = model.model.layers[0].mixer
    assert (mixer.num_heads, mixer.head_dim, mixer.num_levels) == (4, 32, 11)
    assert isinstance(model.model.layers[3].mixer, AttentionMixer)


@pytest.mark.parametrize("size", ["tiny", "125m", "340m", "760m", "1.3b"])
def test_size_presets_build_with_the_analytic_parameter_count(size):
    config, model = fc.preset_model("loglinear_gated_deltanet", size)
    c = config.hidden_size
    h = {128: 1, 768: 2, 1024: 3, 1536: 5, 2048: 6}[c]
    k, v = 256, 512
    levels = (config.max_position_embeddings - 1).bit_length() + 1  # 11 at tiny (1024), else 12 (2048)
    mixer = (c * h * (2 * k + 2 * v + 2)    # q, k, v, g, a, b projections
             + c * h * levels + h * levels  # l_proj and L
             + 4 * h * (2 * k + v)          # the three convs (no bias)
             + 2 * h + v + h * v * c)       # A_log, dt_bias, per-head norm weight, o_proj
    fc.check_parameter_count(model, config, mixer)


@pytest.mark.slow
def test_train_py_runs_loglinear_gated_deltanet(tmp_path):
    overrides = ["model=loglinear_gated_deltanet", "model/size=tiny", "model.mixer_kwargs.head_dim=32"]
    config = fc.run_train_py(tmp_path, overrides, steps=4, seq_len=96)
    assert "loglinear_gated_deltanet" in config
