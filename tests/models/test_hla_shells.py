"""models: decayed HLA operators inside the Mamba-2 and Gated DeltaNet shells (config.mixer mamba2 / gated_deltanet
with config.operator hla2 / ahla / hla3: models/mixers/hla_mamba2.py, hla_gated_deltanet.py).

Each layer is checked against a float64 definition written out here (the shell: projections, causal
conv + SiLU, gates, D skip, gated norm) and docs/kernels.md (the operator as masked sums over index tuples with the
decay weights, not the linear_attn compositions the kernels run).
"""

import json

import family_checks as fc
import pytest
import torch
import torch.nn.functional as F

from models import HiloForCausalLM, build_config, build_model
from models.mixers.attention import AttentionMixer
from models.mixers.gated_deltanet import GatedDeltaNetMixer
from models.mixers.hla_gated_deltanet import HLAGatedDeltaNetMixer
from models.mixers.hla_mamba2 import HLAMamba2Mixer
from models.mixers.mamba2 import Mamba2Mixer

VOCAB = 89
SHELL_KWARGS = {"mamba2": {"head_dim": 16, "state_size": 12, "expand": 2},
                "gated_deltanet": {"head_dim": 16, "num_heads": 3, "expand_v": 2}}
MIXERS = {"mamba2": HLAMamba2Mixer, "gated_deltanet": HLAGatedDeltaNetMixer}
CASES = [(shell, op) for shell in SHELL_KWARGS for op in ("hla2", "ahla", "hla3")]


def small(shell, op, seed=0, mixer_kwargs=None, **overrides) -> HiloForCausalLM:
    torch.manual_seed(seed)
    return build_model({"vocab_size": VOCAB, "hidden_size": 48, "num_layers": 2, "num_heads": 3, "mixer": shell,
                        "operator": op, "mixer_kwargs": {**SHELL_KWARGS[shell], **(mixer_kwargs or {})},
                        **overrides}).eval()


tokens = fc.token_maker(VOCAB)


# ---- the definition ------------------------------------------------------------------------------------------


def masked_sums(op, q, k, v, g, convention="d1"):
    """The operator per batch row and head as sums over index tuples: q, k [B, T, H, K], v [B, T, H, V], g [B, T, H];
    b_t = exp(sum_{r <= t} g_r) and every weight a product of ratios b_x / b_y."""
    t = q.shape[1]
    lb = torch.cumsum(g, 1).permute(0, 2, 1)  # log b [B, H, T]
    a = torch.einsum("bxhd,byhd->bhxy", q, k)  # a[x, y] = q_x . k_y
    n = torch.arange(t)

    def r(x, y):  # b_x / b_y over the broadcast grid of the index tensors x, y
        return torch.exp(lb[..., x] - lb[..., y])

    if op == "hla2":  # sum_{i <= j <= t} w (q_t.k_i)(k_i.q_j) v_j
        tt, jj, ii = n[:, None, None], n[None, :, None], n[None, None, :]
        w = r(tt, ii) * (r(jj, ii) if convention == "d1" else r(tt, jj))
        coef = w * ((ii <= jj) & (jj <= tt)) * a[..., tt, ii] * a[..., jj, ii]
        return torch.einsum("bhtji,bjhv->bthv", coef, v)
    if op == "ahla":  # sum_{j <= i <= t} (b_t/b_j) (q_t.k_i)(q_i.k_j) v_j
        tt, ii, jj = n[:, None, None], n[None, :, None], n[None, None, :]
        coef = r(tt, jj) * ((jj <= ii) & (ii <= tt)) * a[..., tt, ii] * a[..., ii, jj]
        return torch.einsum("bhtij,bjhv->bthv", coef, v)
    # hla3: sum_{i, l <= j <= t} (b_t/b_i)(b_j/b_i)(b_j/b_l) (q_t.k_i)(k_i.q_j)(q_j.k_l) v_l
    tt, jj, ii, ll = n[:, None, None, None], n[None, :, None, None], n[None, None, :, None], n[None, None, None, :]
    w = r(tt, ii) * r(jj, ii) * r(jj, ll) * ((ii <= jj) & (ll <= jj) & (jj <= tt))
    coef = w * a[..., tt, ii] * a[..., jj, ii] * a[..., jj, ll]
    return torch.einsum("bhtjil,blhv->bthv", coef, v)


def causal_conv(x, conv):
    """bias + sum_{lag} w[K-1-lag] x_{t-lag} per channel, zeros before the start; x [B, T, C] float64."""
    w = conv.weight.double()[:, 0, :]
    ksize = w.shape[1]
    y = torch.zeros_like(x) + (0 if conv.bias is None else conv.bias.double())
    for lag in range(ksize):
        y[:, lag:] += w[:, ksize - 1 - lag] * x[:, :x.shape[1] - lag]
    return y


def unit(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def silu(x):
    return x * torch.sigmoid(x)


def rms(x, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def mamba2_definition(mixer, x, eps, operator=None, convention=None, decay=True):
    """The mamba2 shell around the operator, float64: q = C/|C|, k = B/|B|, v = x dt, g = A dt."""
    bsz, t, _ = x.shape
    h, p, n, grp = mixer.num_heads, mixer.head_dim, mixer.state_size, mixer.n_groups
    inner = h * p
    proj = x @ mixer.in_proj.weight.double().T
    z, xbc, dt_raw = proj[..., :inner], proj[..., inner:2 * inner + 2 * grp * n], proj[..., 2 * inner + 2 * grp * n:]
    xbc = silu(causal_conv(xbc, mixer.conv.conv))
    xs = xbc[..., :inner].reshape(bsz, t, h, p)
    bm = xbc[..., inner:inner + grp * n].reshape(bsz, t, grp, n).repeat_interleave(h // grp, 2)
    cm = xbc[..., inner + grp * n:].reshape(bsz, t, grp, n).repeat_interleave(h // grp, 2)
    dt = F.softplus(dt_raw + mixer.dt_bias.double())
    g = -torch.exp(mixer.A_log.double()) * dt if decay else torch.zeros_like(dt)
    y = masked_sums(operator or mixer.operator, unit(cm), unit(bm), xs * dt[..., None], g,
                    convention or mixer.decay_convention)
    y = (y + mixer.D.double()[:, None] * xs).reshape(bsz, t, inner) * silu(z)
    y = rms(y.reshape(bsz, t, grp, inner // grp), eps).reshape(bsz, t, inner) * mixer.norm.weight.double()
    return y @ mixer.out_proj.weight.double().T


def gdn_definition(mixer, x, eps, operator=None, convention=None, decay=True):
    """The gated_deltanet shell around the operator (no beta), float64."""
    bsz, t, _ = x.shape
    h, dk, dv = mixer.num_heads, mixer.head_dim, mixer.head_v_dim

    def lin(layer):
        return x @ layer.weight.double().T

    q = unit(silu(causal_conv(lin(mixer.q_proj), mixer.q_conv.conv)).reshape(bsz, t, h, dk))
    k = unit(silu(causal_conv(lin(mixer.k_proj), mixer.k_conv.conv)).reshape(bsz, t, h, dk))
    v = silu(causal_conv(lin(mixer.v_proj), mixer.v_conv.conv)).reshape(bsz, t, h, dv)
    g = -torch.exp(mixer.A_log.double()) * F.softplus(lin(mixer.a_proj) + mixer.dt_bias.double())
    o = masked_sums(operator or mixer.operator, q, k, v, g if decay else torch.zeros_like(g),
                    convention or mixer.decay_convention)
    o = rms(o, eps) * mixer.norm.weight.double() * silu(lin(mixer.g_proj).reshape(bsz, t, h, dv))
    return o.reshape(bsz, t, h * dv) @ mixer.o_proj.weight.double().T


DEFINITIONS = {"mamba2": mamba2_definition, "gated_deltanet": gdn_definition}


@pytest.mark.parametrize("shell, op, kwargs", [
    ("mamba2", "hla2", {}),
    ("mamba2", "hla2", {"decay_convention": "d2", "n_groups": 2}),
    ("mamba2", "ahla", {"n_groups": 2}),
    ("mamba2", "hla3", {}),
    ("gated_deltanet", "hla2", {}),
    ("gated_deltanet", "hla2", {"decay_convention": "d2", "head_dim": 136, "num_heads": 1}),  # V = 272: 2 blocks
    ("gated_deltanet", "ahla", {"head_dim": 136, "num_heads": 1}),
    ("gated_deltanet", "hla3", {}),
])
def test_layer_equals_the_definition(shell, op, kwargs):
    model = small(shell, op, seed=1, mixer_kwargs=kwargs)
    mixer = model.model.layers[0].mixer
    assert type(mixer) is MIXERS[shell] and mixer.operator == op
    with torch.no_grad():  # every 1-D parameter off its init (norm weight, D, conv bias), and decays that matter
        for p in mixer.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn(p.shape))
        mixer.dt_bias.add_(1.5)
    x = torch.randn(2, 8, 48, dtype=torch.float64)
    with torch.no_grad():
        out = mixer.double()(x, torch.arange(8).expand(2, 8))
    define = DEFINITIONS[shell]
    ref = define(mixer, x, model.config.norm_eps)

    def err(other):
        return ((out - other).abs().max() / other.abs().max()).item()

    # the decay is computed in fp32 like every gate (errors measured: 1e-10 to 3e-8)
    assert err(ref) < 1e-6
    # the comparison tells the decay, its convention and the operator apart (by 1e-3 or more: D x and the gated
    # norm dilute the operator's share of the output)
    assert err(define(mixer, x, model.config.norm_eps, decay=False)) > 5e-4
    other = {"hla2": "ahla", "ahla": "hla2", "hla3": "hla2"}[op]
    assert err(define(mixer, x, model.config.norm_eps, operator=other, convention="d1")) > 5e-4
    if op == "hla2":
        swapped = {"d1": "d2", "d2": "d1"}[mixer.decay_convention]
        assert err(define(mixer, x, model.config.norm_eps, convention=swapped)) > 5e-4


# ---- the models ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shell, op, kwargs", [
    *[(shell, op, {"decay_convention": "d2"} if (shell, op) == ("mamba2", "hla2") else {}) for shell, op in CASES],
    ("gated_deltanet", "hla3", {"head_dim": 136, "num_heads": 1}),  # V = 272: the state of two value blocks
])
def test_decoding_step_by_step_equals_full_forward(shell, op, kwargs):
    model = small(shell, op, seed=2, mixer_kwargs=kwargs)
    # steps and chunks continuing the state
    cache = fc.decode_from_empty_cache(model, tokens(2, 14, seed=3), [(1, 6), (6, 7), (7, 8), (8, 13), (13, 14)])
    slot = cache[0]
    fields = {"hla2": ("S", "F"), "ahla": ("P", "E"), "hla3": ("S", "P", "F")}[op]
    if shell == "mamba2":  # (heads, K, V) of the state: (expand * hidden / P, N, P)
        heads, key, value = 6, 12, 16
    else:  # (heads, head_dim, expand_v * head_dim)
        heads, key = kwargs.get("num_heads", 3), kwargs.get("head_dim", 16)
        value = 2 * key
    for f in fields:
        assert slot[f].dtype == torch.float32 and slot[f].shape == (2, heads, key, key if f == "S" else value)
    assert "recurrent_state" not in slot
    assert ("conv_state" in slot) == (shell == "mamba2") and ("conv_q" in slot) == (shell == "gated_deltanet")


@pytest.mark.parametrize("shell, op", [("mamba2", "hla2"), ("gated_deltanet", "ahla")])
def test_generate_with_cache_equals_greedy_without(shell, op):
    fc.check_generate_equals_greedy(small(shell, op, seed=4), tokens(1, 5, seed=5), 6)


@pytest.mark.parametrize("shell, op", CASES)
def test_varlen_packed_equals_documents_one_by_one(shell, op):
    fc.check_varlen_packed(small(shell, op, seed=6), tokens, [5, 1, 11, 7], leak_min=1e-3, every_document=False)


@pytest.mark.parametrize("shell, op", [("mamba2", "ahla"), ("gated_deltanet", "hla2"), ("gated_deltanet", "hla3")])
def test_save_and_auto_load_round_trip(tmp_path, shell, op):
    model = small(shell, op, seed=7)
    loaded = fc.check_save_load_round_trip(model, tmp_path, tokens(2, 11, seed=8), same_parameters=False)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["operator"] == op and saved["mixer"] == shell
    assert type(loaded.model.layers[1].mixer) is MIXERS[shell]
    assert loaded.config.operator == op and loaded.model.layers[1].mixer.operator == op


@pytest.mark.parametrize("shell, op", CASES)
def test_training_steps_lower_the_loss_on_a_fixed_batch(shell, op):
    fc.check_training_drops_loss_by(small(shell, op, seed=9).train(), tokens(4, 32, seed=10), 0.5,
                                    check_first_grads=True)


def test_gdn_hla_has_no_beta_projection_and_shells_keep_their_parameters():
    hla = small("gated_deltanet", "ahla").model.layers[0].mixer
    plain = small("gated_deltanet", None).model.layers[0].mixer
    assert type(plain) is GatedDeltaNetMixer and hasattr(plain, "b_proj") and not hasattr(hla, "b_proj")
    assert set(dict(plain.named_parameters())) - set(dict(hla.named_parameters())) == {"b_proj.weight"}
    m_hla = small("mamba2", "hla3").model.layers[0].mixer
    m_plain = small("mamba2", "linear_attn").model.layers[0].mixer  # the shell's own operator, named
    assert type(m_plain) is Mamba2Mixer
    assert {n: p.shape for n, p in m_hla.named_parameters()} == {n: p.shape for n, p in m_plain.named_parameters()}


def test_flops_per_token_hand_count():
    # one pass LA(Q, K, W) costs 2C(K + W) + 4KW forward, 3x with the backward; C = min(64, T)
    m = small("mamba2", "hla2").model.layers[0].mixer  # 6 heads, N = 12, P = 16, conv over 96 + 24 channels
    passes = (2 * 64 * 24 + 4 * 144) + (2 * 64 * 28 + 4 * 192)
    assert m.flops_per_token(4096) == 3 * 6 * passes + 6 * 4 * 120
    g = small("gated_deltanet", "hla3", mixer_kwargs={"head_dim": 136, "num_heads": 1}).model.layers[0].mixer
    # V = 272 in blocks of 256 and 16: per block the key pass (W = 136) and two value passes (W = block width)
    blocks = [(2 * 16 * 272 + 4 * 136 * 136) + 2 * (2 * 16 * (136 + w) + 4 * 136 * w) for w in (256, 16)]
    assert g.flops_per_token(16) == 3 * sum(blocks) + 6 * 4 * (136 + 136 + 272)


def test_errors_are_clear():
    with pytest.raises(ValueError, match=r"unknown operator 'delta_rule' for mixer 'mamba2'; valid operators: "
                                         r"\['linear_attn', 'hla2', 'ahla', 'hla3'\]"):
        small("mamba2", "delta_rule")
    with pytest.raises(ValueError, match=r"unknown operator 'softmax_attn' for mixer 'gated_deltanet'; valid "
                                         r"operators: \['delta_rule', 'hla2', 'ahla', 'hla3'\]"):
        small("gated_deltanet", "softmax_attn")
    with pytest.raises(ValueError, match="mixer 'loglinear_mamba2' takes no operator"):
        build_model({"vocab_size": VOCAB, "hidden_size": 48, "num_layers": 1, "num_heads": 3,
                     "mixer": "loglinear_mamba2", "operator": "hla2"})
    for shell in SHELL_KWARGS:
        with pytest.raises(ValueError, match=f"hla_{shell}: decay_convention must be 'd1', or 'd2' for operator "
                                             f"hla2; got 'd2' for operator 'ahla'"):
            small(shell, "ahla", mixer_kwargs={"decay_convention": "d2"})
        with pytest.raises(ValueError, match=f"unknown mixer_kwargs \\['decay'\\] for mixer 'hla_{shell}'"):
            small(shell, "hla2", mixer_kwargs={"decay": True})
        with pytest.raises(ValueError, match=f"unknown mixer_kwargs \\['decay_convention'\\] for mixer '{shell}'"):
            small(shell, None, mixer_kwargs={"decay_convention": "d1"})
    # the HLA operators take value heads up to 256 per call (the delta rule's 512 is not theirs)
    with pytest.raises(ValueError, match=r"hla_gated_deltanet value_block must be in 1\.\.256.*got 512"):
        small("gated_deltanet", "hla2", mixer_kwargs={"value_block": 512})
    with pytest.raises(ValueError, match="set mixer=mamba2 and operator=hla2"):
        build_model({"vocab_size": VOCAB, "hidden_size": 48, "num_layers": 1, "num_heads": 3, "mixer": "hla_mamba2"})


# ---- configs and the command line ----------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, shell, op", [
    (["model=hla_mamba2"], "mamba2", "hla2"),
    (["model=hla_gated_deltanet"], "gated_deltanet", "ahla"),
    (["model=mamba2", "model.operator=hla3"], "mamba2", "hla3"),  # the plain shells switched by the override
    (["model=gated_deltanet", "model.operator=hla2"], "gated_deltanet", "hla2"),
])
def test_hydra_presets_compose_into_hla_shell_models(overrides, shell, op):
    from omegaconf import OmegaConf

    cfg = fc.compose([*overrides, "model/size=tiny", "model.attn_layers=[2]"])
    config = build_config({**OmegaConf.to_container(cfg.model, resolve=True), "vocab_size": 1000})
    assert config.mixer == shell and config.operator == op
    assert config.mixer_kwargs.get("decay_convention", "d1") == "d1"
    with torch.device("meta"):
        model = HiloForCausalLM(config)
    cls = MIXERS[shell]
    assert [type(b.mixer) for b in model.model.layers] == [cls, cls, AttentionMixer, cls]
    mixer = model.model.layers[0].mixer
    if shell == "mamba2":  # tiny: hidden 128, 4 heads of P = 64, N = 128; in_proj [z | x, B, C | dt]
        assert (mixer.num_heads, mixer.head_dim, mixer.state_size) == (4, 64, 128)
        n = 128 * (256 + 256 + 2 * 128 + 4) + 4 * (256 + 2 * 128) + (256 + 2 * 128) + 3 * 4 + 256 + 256 * 128
    else:  # tiny: 1 head of K = 256, V = 512; q, k, v, a, g projections (no b_proj), three convs, A_log, dt_bias
        assert (mixer.num_heads, mixer.head_dim, mixer.head_v_dim) == (1, 256, 512)
        n = 128 * (256 + 256 + 512 + 1 + 512) + 4 * (256 + 256 + 512) + 2 + 512 + 512 * 128
    assert sum(p.numel() for p in mixer.parameters()) == n


@pytest.mark.slow
def test_train_py_runs_hla_gated_deltanet(tmp_path):
    saved = json.loads(fc.run_train_py(tmp_path, ["model=hla_gated_deltanet", "model/size=tiny"], steps=3))
    assert saved["operator"] == "ahla" and saved["mixer"] == "gated_deltanet"
