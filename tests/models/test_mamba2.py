"""models: the Mamba-2 mixer and model (CPU, fp32, small shapes).

The layer is checked against a token-by-token float64 re-derivation of SPEC §5's mamba2 shell written out here
(not the module's code path); the model against itself across decode / varlen / save-load / training.
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
from models.mixers.mamba2 import Mamba2Mixer

REPO = Path(__file__).resolve().parents[2]
VOCAB = 89
SMALL = dict(head_dim=16, state_size=12, expand=2, n_groups=1)
TINY = dict(vocab_size=VOCAB, hidden_size=48, num_layers=2, num_heads=3, mixer="mamba2", mixer_kwargs=SMALL)


def tiny(seed=0, **overrides) -> HiloForCausalLM:
    torch.manual_seed(seed)
    return build_model({**TINY, **overrides}).eval()


def tokens(*shape, seed=0):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def perturb(model: nn.Module, seed: int = 0) -> None:
    """Move every parameter the default init leaves at a special value (D = 1, norm weights = 1, conv bias) so
    a test cannot pass by accident of the init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=g))


def reference_mamba2(mixer: Mamba2Mixer, hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """SPEC §5 mamba2 shell, one token at a time, float64, from the mixer's parameters."""
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
    hidden = torch.randn(2, t, 48, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = mixer(hidden, torch.arange(t).expand(2, t))
    ref = reference_mamba2(mixer, hidden, model.config.norm_eps)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-5, err


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

    model = tiny(seed=5, hidden_size=256, num_heads=4, mixer_kwargs={"head_dim": 4, "state_size": 4})  # 128 heads per layer
    mixer = model.model.layers[1].mixer
    a = -torch.exp(mixer.A_log.detach())
    assert a.shape == (128,) and a.min() >= -16 and a.max() <= -1
    assert a.min() < -12 and a.max() > -5  # spread over the range, not a constant
    dt = F.softplus(mixer.dt_bias.detach())
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 1e-1 * (1 + 1e-5)
    # log-uniform: about half the heads below the geometric midpoint 1e-2
    assert 0.3 < (dt < 1e-2).float().mean() < 0.7 and dt.min() < 2e-3 and dt.max() > 5e-2
    assert torch.equal(mixer.D.detach(), torch.ones(128))
    assert torch.equal(mixer.norm.weight.detach(), torch.ones(512))
    for p in (mixer.A_log, mixer.dt_bias, mixer.D):
        assert getattr(p, "_no_weight_decay", False)
    decay, no_decay = split_decay_groups(model, [])
    ids = {id(p) for p in no_decay}
    assert all(id(p) in ids for p in (mixer.A_log, mixer.dt_bias, mixer.D))
    assert id(mixer.in_proj.weight) in {id(p) for p in decay}
    std = model.config.initializer_range
    assert abs(mixer.in_proj.weight.std().item() - std) < 0.1 * std
    assert abs(mixer.out_proj.weight.std().item() - std / math.sqrt(2 * 2)) < 0.1 * std


def test_cached_decode_equals_full_forward():
    model = tiny(seed=2)
    perturb(model, seed=4)
    x = tokens(2, 23, seed=3)
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        out = model(x[:, :2], use_cache=True)  # a prompt shorter than the conv window
        cache = out.get("cache", out.get("past_key_values"))
        steps = [out.logits]
        for a, b in [(2, 3), (3, 4), (4, 9), (9, 10)] + [(i, i + 1) for i in range(10, 23)]:
            steps.append(model(x[:, a:b], cache=cache, use_cache=True).logits)
    assert isinstance(cache, HiloCache) and cache.get_seq_length() == 23
    slot = cache[0]
    assert slot["conv_state"].shape == (2, 96 + 2 * 12, 3)
    assert slot["recurrent_state"].shape == (2, 6, 12, 16) and slot["recurrent_state"].dtype == torch.float32
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
    lengths = [5, 1, 15, 2, 9]  # lengths 1 and 2 are shorter than the conv window
    docs = [tokens(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    packed = torch.cat(docs, dim=1)
    cu = torch.tensor([0, 5, 6, 21, 23, 32])
    with torch.no_grad():
        out = model(packed, cu_seqlens=cu).logits
        singles = torch.cat([model(d, use_cache=False).logits for d in docs], dim=1)
        unpacked = model(packed, use_cache=False).logits
    torch.testing.assert_close(out, singles, atol=1e-5, rtol=0)
    # without cu_seqlens the conv and the state leak across documents: every later document changes
    for s, e in zip(cu[1:-1].tolist(), cu[2:].tolist()):
        assert (unpacked[:, s:e] - out[:, s:e]).abs().max() > 1e-4


def test_hybrid_with_attention_layers_decodes_and_packs():
    model = tiny(seed=5, num_layers=3, attn_layers=[1])
    assert [type(b.mixer) for b in model.model.layers] == [Mamba2Mixer, AttentionMixer, Mamba2Mixer]
    assert model.model.layers[1].mixer.head_dim == 16  # attention: hidden_size / num_heads
    x = tokens(1, 14, seed=7)
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        out = model(x[:, :6], use_cache=True)
        cache = out.get("cache", out.get("past_key_values"))
        steps = [out.logits] + [model(x[:, i:i + 1], cache=cache).logits for i in range(6, 14)]
        packed = model(x, cu_seqlens=torch.tensor([0, 6, 14])).logits
        second = model(x[:, 6:], use_cache=False).logits
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=0)
    assert cache[1]["key"].shape[1] == 14 and "recurrent_state" in cache[0] and "key" not in cache[0]
    torch.testing.assert_close(packed[:, 6:], second, atol=1e-5, rtol=0)


def test_save_and_auto_load_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny(seed=6, mixer_kwargs={**SMALL, "n_groups": 2, "state_size": 8})
    perturb(model, seed=7)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, HiloForCausalLM) and loaded.config.mixer == "mamba2"
    assert loaded.config.mixer_kwargs["n_groups"] == 2 and loaded.model.layers[0].mixer.state_size == 8
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
    h, k, v, conv = 6, 12, 16, 96 + 2 * 12
    for t, c in ((1, 1), (40, 40), (4096, 64)):
        assert mixer.flops_per_token(t) == 3 * h * (2 * c * (k + v) + 4 * k * v) + 6 * 4 * conv
    n_lin = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert model.num_flops_per_token(128) == 6 * n_lin + 2 * mixer.flops_per_token(128)


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match=r"unknown mixer_kwargs \['state'\].*valid keys.*state_size"):
        tiny(mixer_kwargs={"state": 4})
    with pytest.raises(ValueError, match="multiple of head_dim"):
        tiny(mixer_kwargs={"head_dim": 10})
    with pytest.raises(ValueError, match="n_groups"):
        tiny(mixer_kwargs={**SMALL, "n_groups": 4})


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def test_hydra_compose_mamba2_with_sizes_and_overrides():
    from omegaconf import OmegaConf

    cfg = _compose(["model=mamba2", "model/size=340m", "model.mixer_kwargs.state_size=64"])
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    assert cfg.name.startswith("mamba2-340m-")
    config = build_config({**model_cfg, "vocab_size": 1000})
    assert config.mixer == "mamba2" and config.hidden_size == 1024 and config.num_layers == 24
    assert config.mixer_kwargs["state_size"] == 64 and config.mixer_kwargs["head_dim"] == 64
    with torch.device("meta"):
        model = HiloForCausalLM(config)
    mixer = model.model.layers[0].mixer
    assert isinstance(mixer, Mamba2Mixer) and mixer.num_heads == 2 * 1024 // 64 and mixer.state_size == 64
    tiny_cfg = _compose(["model=mamba2", "model/size=tiny", "model.attn_layers=[1]"])
    config = build_config({**OmegaConf.to_container(tiny_cfg.model, resolve=True), "vocab_size": 100})
    assert config.hidden_size == 128 and config.attn_layers == [1]


@pytest.mark.slow
def test_train_py_runs_mamba2(tmp_path):
    run_dir = tmp_path / "run"
    res = subprocess.run(
        [sys.executable, "train.py", "model=mamba2", "model/size=tiny", "trainer.max_steps=4", "logger=none",
         "trainer.seq_len=64", "trainer.batch_size=2", "trainer.val_batches=1", "trainer.progress_bar=false",
         f"hydra.run.dir={run_dir}"],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = (run_dir / "summary.json").read_text()
    assert '"step": 4' in summary
    assert "mamba2" in (run_dir / "checkpoints" / "step_00000004" / "model" / "config.json").read_text()


@pytest.mark.parametrize("size", ["tiny", "125m", "340m", "760m", "1.3b"])
def test_size_presets_build_with_the_analytic_parameter_count(size):
    import yaml

    conf = REPO / "conf" / "model"
    cfg = {**yaml.safe_load((conf / "mamba2.yaml").read_text()),
           **yaml.safe_load((conf / "size" / f"{size}.yaml").read_text()), "vocab_size": 1000}
    config = build_config(cfg)
    with torch.device("meta"):
        model = HiloForCausalLM(config)
    c, inner, n = config.hidden_size, 2 * config.hidden_size, 128
    h, conv_dim = inner // 64, inner + 2 * n
    mixer = (c * (inner + conv_dim + h) + conv_dim * 4 + conv_dim  # in_proj, conv weight and bias
             + 3 * h + inner + inner * c)                           # A_log, dt_bias, D, gated norm, out_proj
    block = mixer + 3 * c * config.intermediate_size + 2 * c
    expected = config.num_layers * block + 2 * 1000 * c + c
    assert sum(p.numel() for p in model.parameters()) == expected
    assert model.model.layers[0].mixer.num_heads == h
