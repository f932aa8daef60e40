"""models: the Gated DeltaNet mixer and model (CPU, fp32, small shapes).

The layer is checked against a token-by-token float64 re-derivation of SPEC §5's gated_deltanet shell written
out here (not the module's code path); the model against itself across decode / varlen / save-load / training.
"""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import HiloCache, HiloForCausalLM, build_config, build_model
from models.mixers.attention import AttentionMixer
from models.mixers.gated_deltanet import GatedDeltaNetMixer

REPO = Path(__file__).resolve().parents[2]
VOCAB = 89
SMALL = dict(head_dim=16, num_heads=3, expand_v=2)
TINY = dict(vocab_size=VOCAB, hidden_size=48, num_layers=2, num_heads=3, mixer="gated_deltanet", mixer_kwargs=SMALL)


def tiny(seed=0, **overrides) -> HiloForCausalLM:
    torch.manual_seed(seed)
    return build_model({**TINY, **overrides}).eval()


def tokens(*shape, seed=0):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def perturb(model: nn.Module, seed: int = 0) -> None:
    """Move the 1-D parameters (norm weights at 1, A_log, dt_bias) off their init so nothing passes by accident."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=g))


def causal_conv_silu(x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """SiLU(sum_j w[:, j] x_{t-(K-1)+j}) with zeros before the start, float64, token by token."""
    w = conv.weight.double()[:, 0, :]
    kk = w.shape[1]
    out = torch.zeros_like(x)
    for i in range(x.shape[1]):
        for j in range(kk):
            if i - (kk - 1) + j >= 0:
                out[:, i] += w[:, j] * x[:, i - (kk - 1) + j]
    return out * torch.sigmoid(out)


def reference_gdn(mixer: GatedDeltaNetMixer, hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """SPEC §5 gated_deltanet shell, one token at a time, float64, from the mixer's parameters."""
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


@pytest.mark.parametrize("kwargs, t", [(SMALL, 9), (dict(head_dim=144, num_heads=1, expand_v=2), 5)])
def test_layer_equals_token_by_token_reference(kwargs, t):
    # the second case has value heads of 288 > 256 columns: the mixer runs the operator on column blocks
    model = tiny(seed=1, mixer_kwargs=kwargs)
    perturb(model, seed=2)
    mixer = model.model.layers[0].mixer
    assert mixer.head_v_dim == 2 * kwargs["head_dim"]
    hidden = torch.randn(2, t, 48, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = mixer(hidden, torch.arange(t).expand(2, t))
    ref = reference_gdn(mixer, hidden, model.config.norm_eps)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-5, err


def test_default_head_count_follows_hidden_size():
    shapes = {}
    for hidden in (2048, 1024, 128):
        config = build_config(dict(vocab_size=10, hidden_size=hidden, num_layers=1, num_heads=16,
                                   mixer="gated_deltanet"))
        with torch.device("meta"):
            mixer = GatedDeltaNetMixer(config, 0)
        shapes[hidden] = (mixer.num_heads, mixer.head_dim, mixer.head_v_dim)
    assert shapes == {2048: (6, 256, 512), 1024: (3, 256, 512), 128: (1, 256, 512)}


def test_forward_backward_finite_with_all_grads():
    model = tiny(seed=0).train()
    x = tokens(2, 37)
    out = model(x, labels=x, use_cache=False)
    assert out.logits.shape == (2, 37, VOCAB)
    assert torch.isfinite(out.loss) and abs(out.loss.item() - math.log(VOCAB)) < 0.5
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_init_ranges_and_no_weight_decay_flags():
    from training.optim import split_decay_groups

    model = tiny(seed=5, mixer_kwargs={"head_dim": 4, "num_heads": 128})
    mixer = model.model.layers[1].mixer
    a = -torch.exp(mixer.A_log.detach())
    assert a.shape == (128,) and a.min() >= -16 and a.max() <= -1
    assert a.min() < -12 and a.max() > -5
    dt = F.softplus(mixer.dt_bias.detach())
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 1e-1 * (1 + 1e-5)
    assert 0.3 < (dt < 1e-2).float().mean() < 0.7 and dt.min() < 2e-3 and dt.max() > 5e-2
    assert torch.equal(mixer.norm.weight.detach(), torch.ones(8))
    for p in (mixer.A_log, mixer.dt_bias):
        assert getattr(p, "_no_weight_decay", False)
    decay, no_decay = split_decay_groups(model, [])
    ids = {id(p) for p in no_decay}
    assert id(mixer.A_log) in ids and id(mixer.dt_bias) in ids
    assert id(mixer.q_proj.weight) in {id(p) for p in decay}
    std = model.config.initializer_range
    assert abs(mixer.v_proj.weight.std().item() - std) < 0.1 * std
    assert abs(mixer.o_proj.weight.std().item() - std / math.sqrt(2 * 2)) < 0.1 * std


def test_cached_decode_equals_full_forward():
    model = tiny(seed=2)
    perturb(model, seed=4)
    x = tokens(2, 23, seed=3)
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        out = model(x[:, :1], use_cache=True)  # a one-token prompt: decoding starts from an empty state
        cache = out.get("cache", out.get("past_key_values"))
        steps = [out.logits]
        for a, b in [(1, 2), (2, 3), (3, 9), (9, 10)] + [(i, i + 1) for i in range(10, 23)]:
            steps.append(model(x[:, a:b], cache=cache, use_cache=True).logits)
    assert isinstance(cache, HiloCache) and cache.get_seq_length() == 23
    slot = cache[1]
    assert slot["conv_q"].shape == (2, 48, 3) and slot["conv_v"].shape == (2, 96, 3)
    assert slot["recurrent_state"].shape == (2, 3, 16, 32) and slot["recurrent_state"].dtype == torch.float32
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=0)


def test_cached_decode_with_wide_value_heads():
    # V = 288 > 256: the operator and its decode step both run in column blocks
    model = tiny(seed=3, mixer_kwargs=dict(head_dim=144, num_heads=1, expand_v=2))
    x = tokens(1, 9, seed=4)
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        out = model(x[:, :4], use_cache=True)
        cache = out.get("cache", out.get("past_key_values"))
        steps = [out.logits] + [model(x[:, i:i + 1], cache=cache).logits for i in range(4, 9)]
    assert cache[0]["recurrent_state"].shape == (1, 1, 144, 288)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=0)


def test_generate_feeds_one_token_per_step_and_equals_greedy():
    model = tiny(seed=3)
    prompt = tokens(1, 5, seed=6)
    fed = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, inp, out: fed.append(inp[0].shape[1]))
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    hook.remove()
    assert fed == [5] + [1] * 5
    seq = prompt
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, seq)


def test_varlen_packed_equals_documents_one_by_one():
    model = tiny(seed=4)
    perturb(model, seed=5)
    lengths = [5, 1, 15, 2, 9]
    docs = [tokens(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    packed = torch.cat(docs, dim=1)
    cu = torch.tensor([0, 5, 6, 21, 23, 32])
    with torch.no_grad():
        out = model(packed, cu_seqlens=cu).logits
        singles = torch.cat([model(d, use_cache=False).logits for d in docs], dim=1)
        unpacked = model(packed, use_cache=False).logits
    torch.testing.assert_close(out, singles, atol=1e-5, rtol=0)
    for s, e in zip(cu[1:-1].tolist(), cu[2:].tolist()):
        assert (unpacked[:, s:e] - out[:, s:e]).abs().max() > 1e-4


def test_hybrid_with_attention_layers_decodes_and_packs():
    model = tiny(seed=5, num_layers=3, attn_layers=[0, 2])
    assert [type(b.mixer) for b in model.model.layers] == [AttentionMixer, GatedDeltaNetMixer, AttentionMixer]
    x = tokens(1, 14, seed=7)
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        out = model(x[:, :6], use_cache=True)
        cache = out.get("cache", out.get("past_key_values"))
        steps = [out.logits] + [model(x[:, i:i + 1], cache=cache).logits for i in range(6, 14)]
        packed = model(x, cu_seqlens=torch.tensor([0, 6, 14])).logits
        second = model(x[:, 6:], use_cache=False).logits
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=0)
    assert cache[0]["key"].shape[1] == 14 and "recurrent_state" in cache[1]
    torch.testing.assert_close(packed[:, 6:], second, atol=1e-5, rtol=0)


def test_save_and_auto_load_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny(seed=6, mixer_kwargs=dict(head_dim=8, num_heads=2, expand_v=1, conv_size=3))
    perturb(model, seed=7)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, HiloForCausalLM) and loaded.config.mixer == "gated_deltanet"
    mixer = loaded.model.layers[0].mixer
    assert (mixer.num_heads, mixer.head_v_dim, mixer.q_conv.kernel_size) == (2, 8, 3)
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), loaded.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    x = tokens(2, 16, seed=8)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_training_steps_on_a_fixed_batch_lower_the_loss():
    from omegaconf import OmegaConf

    from training.optim import build_optimizer

    model = tiny(seed=7).train()
    optim_cfg = OmegaConf.create(dict(name="adamw", lr=3e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1,
                                      no_decay=["embed", "norm", "bias"], fused=False))
    opt = build_optimizer(model, optim_cfg, on_cuda=False)
    x = tokens(4, 32, seed=9)
    losses = []
    for _ in range(12):
        loss = model(x, labels=x, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_flops_per_token_hand_count():
    model = tiny()
    mixer = model.model.layers[0].mixer
    h, k, v = 3, 16, 32
    for t, c in ((1, 1), (40, 40), (4096, 64)):
        expected = 3 * h * (6 * c * k + 4 * c * v + 6 * k * v + c * c) + 6 * 4 * (2 * h * k + h * v)
        assert mixer.flops_per_token(t) == expected
    n_lin = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert model.num_flops_per_token(128) == 6 * n_lin + 2 * mixer.flops_per_token(128)


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match=r"unknown mixer_kwargs \['heads'\].*valid keys.*num_heads"):
        tiny(mixer_kwargs={"heads": 4})
    with pytest.raises(ValueError, match="head_dim must be <= 256"):
        tiny(mixer_kwargs={"head_dim": 320})


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def test_hydra_compose_gated_deltanet_with_sizes_and_overrides():
    from omegaconf import OmegaConf

    cfg = _compose(["model=gated_deltanet", "model/size=1.3b"])
    assert cfg.name.startswith("gated_deltanet-1.3b-")
    config = build_config({**OmegaConf.to_container(cfg.model, resolve=True), "vocab_size": 1000})
    with torch.device("meta"):
        model = HiloForCausalLM(config)
    mixer = model.model.layers[0].mixer
    assert isinstance(mixer, GatedDeltaNetMixer) and config.num_layers == 24
    assert (mixer.num_heads, mixer.head_dim, mixer.head_v_dim) == (6, 256, 512)
    cfg = _compose(["model=gated_deltanet", "model/size=tiny", "model.mixer_kwargs.head_dim=32",
                    "model.mixer_kwargs.num_heads=4", "model.attn_layers=[3]"])
    config = build_config({**OmegaConf.to_container(cfg.model, resolve=True), "vocab_size": 100})
    model = HiloForCausalLM(config)
    mixer = model.model.layers[0].mixer
    assert (mixer.num_heads, mixer.head_dim, mixer.head_v_dim) == (4, 32, 64)
    assert isinstance(model.model.layers[3].mixer, AttentionMixer)


@pytest.mark.slow
def test_train_py_runs_gated_deltanet(tmp_path):
    run_dir = tmp_path / "run"
    res = subprocess.run(
        [sys.executable, "train.py", "model=gated_deltanet", "model/size=tiny", "trainer.max_steps=4",
         "logger=none", "trainer.seq_len=64", "trainer.batch_size=2", "trainer.val_batches=1",
         "trainer.progress_bar=false", f"hydra.run.dir={run_dir}"],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert '"step": 4' in (run_dir / "summary.json").read_text()
    assert "gated_deltanet" in (run_dir / "checkpoints" / "step_00000004" / "model" / "config.json").read_text()


@pytest.mark.parametrize("size", ["tiny", "125m", "340m", "760m", "1.3b"])
def test_size_presets_build_with_the_analytic_parameter_count(size):
    import yaml

    conf = REPO / "conf" / "model"
    cfg = {**yaml.safe_load((conf / "gated_deltanet.yaml").read_text()),
           **yaml.safe_load((conf / "size" / f"{size}.yaml").read_text()), "vocab_size": 1000}
    config = build_config(cfg)
    with torch.device("meta"):
        model = HiloForCausalLM(config)
    c = config.hidden_size
    h = {128: 1, 768: 2, 1024: 3, 1536: 5, 2048: 6}[c]
    k, v = 256, 512
    mixer = (c * h * (2 * k + 2 * v + 2)    # q, k, v, g, a, b projections
             + 4 * h * (2 * k + v)          # the three convs (no bias)
             + 2 * h + v + h * v * c)       # A_log, dt_bias, per-head norm weight, o_proj
    block = mixer + 3 * c * config.intermediate_size + 2 * c
    expected = config.num_layers * block + 2 * 1000 * c + c
    assert sum(p.numel() for p in model.parameters()) == expected
    assert model.model.layers[0].mixer.num_heads == h
