"""Checks shared by the model-family tests (test_mamba2, test_gated_deltanet, test_loglinear_*, test_hla_*).

Plain functions: each takes the model (or what builds it) and the family's expectations as arguments, runs the
check with pytest asserts and returns what a family file may need for its own extra asserts. Nothing here is a
test; the family files keep every test's name, seeds and shapes.
"""

import math
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from models import HiloCache, HiloForCausalLM, build_config, build_model

REPO = Path(__file__).resolve().parents[2]


# ---- builders, tokens, perturbation --------------------------------------------------------------------------


def tiny_builder(base: dict):
    """A `tiny(seed=0, **overrides)` that seeds torch and builds an eval-mode model from `base` updated by the
    overrides."""

    def tiny(seed=0, **overrides) -> HiloForCausalLM:
        torch.manual_seed(seed)
        return build_model({**base, **overrides}).eval()

    return tiny


def token_maker(vocab: int):
    """A `tokens(*shape, seed=0)` drawing ids in [0, vocab) from its own seeded generator."""

    def tokens(*shape, seed=0):
        return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))

    return tokens


def perturb(model: nn.Module, seed: int = 0, spread_levels: bool = False) -> None:
    """Move every 1-D parameter (norm weights, D, conv bias, A_log, dt_bias) by 0.3 N(0, 1) off its init so a test
    cannot pass by accident of the init; with spread_levels also set every log-linear `.L` to 12 N(0, 1), so
    lambda spreads over a wide range and the levels are told apart."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            elif spread_levels and name.endswith(".L"):
                p.copy_(12 * torch.randn(p.shape, generator=g))


def causal_conv_silu(x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """SiLU(sum_j w[:, j] x_{t-(K-1)+j}) with zeros before the start (no bias), float64, token by token."""
    w = conv.weight.double()[:, 0, :]
    kk = w.shape[1]
    out = torch.zeros_like(x)
    for i in range(x.shape[1]):
        for j in range(kk):
            if i - (kk - 1) + j >= 0:
                out[:, i] += w[:, j] * x[:, i - (kk - 1) + j]
    return out * torch.sigmoid(out)


# ---- the layer -----------------------------------------------------------------------------------------------


def check_layer_against_reference(model, reference, t: int, hidden_size: int = 48, tol: float = 1e-5):
    """Layer 0's mixer on randn(2, t, hidden) (seed 3) at positions 0..t-1 equals `reference(mixer, hidden, eps)`
    (float64) to a relative max error below tol."""
    mixer = model.model.layers[0].mixer
    hidden = torch.randn(2, t, hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = mixer(hidden, torch.arange(t).expand(2, t))
    ref = reference(mixer, hidden, model.config.norm_eps)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < tol, err


def check_lambda_one_equals_base(mixer, base, loglinear_module, monkeypatch, t: int = 75):
    """A log-linear mixer differs from its plain `base` layer (same weights loaded) by more than 1e-3, and equals it
    to 1e-5 once `level_scales` in `loglinear_module` returns lambda = 1 everywhere. t = 75 is more than one chunk
    of 64, so the chunk-level pass is used."""
    hidden = torch.randn(2, t, 48, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = base(hidden, None)
        assert (mixer(hidden, None) - expected).abs().max() > 1e-3  # lambda != 1 changes the layer
        monkeypatch.setattr(loglinear_module, "level_scales",
                            lambda L, dl, levels: torch.ones(*dl.shape[:-1], L.shape[0], levels))
        out = mixer(hidden, None)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def check_decay_init(mixer, heads: int) -> None:
    """A = -exp(A_log) has `heads` entries in [-16, -1], spread (min < -12, max > -5); dt = softplus(dt_bias) is
    log-uniform in [1e-3, 1e-1] (30-70% below 1e-2, min < 2e-3, max > 5e-2)."""
    a = -torch.exp(mixer.A_log.detach())
    assert a.shape == (heads,) and a.min() >= -16 and a.max() <= -1
    assert a.min() < -12 and a.max() > -5  # spread over the range, not a constant
    dt = torch.nn.functional.softplus(mixer.dt_bias.detach())
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 1e-1 * (1 + 1e-5)
    # log-uniform: about half the heads below the geometric midpoint 1e-2
    assert 0.3 < (dt < 1e-2).float().mean() < 0.7 and dt.min() < 2e-3 and dt.max() > 5e-2


def check_weight_decay_split(model, no_decay, decay, flagged: bool = False) -> None:
    """training.optim.split_decay_groups puts every parameter of no_decay in the no-decay group (each also carrying
    the _no_weight_decay flag when flagged) and every parameter of decay in the decay group."""
    from training.optim import split_decay_groups

    if flagged:
        for p in no_decay:
            assert getattr(p, "_no_weight_decay", False)
    decay_group, no_decay_group = split_decay_groups(model, [])
    ids = {id(p) for p in no_decay_group}
    assert all(id(p) in ids for p in no_decay)
    assert all(id(p) in {id(q) for q in decay_group} for p in decay)


def check_projection_init_std(model, weight, out_weight) -> None:
    """weight has std initializer_range and out_weight (a residual output projection) initializer_range /
    sqrt(2 * num_layers), each within 10% of initializer_range."""
    std = model.config.initializer_range
    assert abs(weight.std().item() - std) < 0.1 * std
    assert abs(out_weight.std().item() - std / math.sqrt(2 * model.config.num_layers)) < 0.1 * std


# ---- the model -----------------------------------------------------------------------------------------------


def assert_all_grads_finite_and_nonzero(model: nn.Module) -> None:
    """Every parameter has a finite, not all-zero gradient."""
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def check_operator_calls_per_value_block(build, tokens, module, op_name: str, monkeypatch, mixer_kwargs: dict,
                                         value_block, widths: list) -> None:
    """The value widths a GDN-style mixer hands `module.op_name` per layer (one layer, with and without a cache) are
    `widths` when mixer_kwargs.value_block is value_block (None: the default). build(seed, num_layers, mixer_kwargs)
    makes the model; tokens(b, t, seed) its input."""
    seen = []
    operator = getattr(module, op_name)

    def recording(q, k, v, *args, **kwargs):
        seen.append(v.shape[-1])
        return operator(q, k, v, *args, **kwargs)

    monkeypatch.setattr(module, op_name, recording)
    kwargs = mixer_kwargs if value_block is None else {**mixer_kwargs, "value_block": value_block}
    model = build(seed=8, num_layers=1, mixer_kwargs=kwargs)
    with torch.no_grad():
        for use_cache in (False, True):
            seen.clear()
            model(tokens(1, 6, seed=9), use_cache=use_cache)
            assert seen == widths, (use_cache, seen)


def check_forward_backward(model, x, vocab: int, labels_only: bool = False):
    """Training-mode forward with labels: logits [B, T, vocab] (unless labels_only), a finite loss within 0.5 of
    log(vocab), and after backward every parameter with a finite non-zero gradient. Returns the output."""
    out = model(x, labels=x) if labels_only else model(x, labels=x, use_cache=False)
    if not labels_only:
        assert out.logits.shape == (*x.shape, vocab)
    assert torch.isfinite(out.loss) and abs(out.loss.item() - math.log(vocab)) < 0.5
    out.loss.backward()
    assert_all_grads_finite_and_nonzero(model)
    return out


def decode_in_pieces(model, x, prompt: int, pieces, *, on_step=None, atol: float = 1e-4):
    """Prefill x[:, :prompt] with use_cache=True, then feed x[:, a:b] for each (a, b) in pieces against the same
    cache: the concatenated logits equal the full uncached forward to atol. on_step(cache), if given, is called
    after the prefill and after every piece; returns (cache, [its results])."""
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        out = model(x[:, :prompt], use_cache=True)
        cache = out.get("cache", out.get("past_key_values"))
        steps, seen = [out.logits], [on_step(cache)] if on_step else []
        for a, b in pieces:
            steps.append(model(x[:, a:b], cache=cache, use_cache=True).logits)
            if on_step:
                seen.append(on_step(cache))
    assert isinstance(cache, HiloCache) and cache.get_seq_length() == x.shape[1]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=atol, rtol=0)
    return cache, seen


def decode_from_empty_cache(model, x, pieces, atol: float = 1e-4):
    """A cache from HiloCache.from_config, x[:, :1] through the step, then x[:, a:b] for each (a, b) in pieces:
    the concatenated logits equal the full uncached forward to atol. Returns the cache."""
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        cache = HiloCache.from_config(model.config)
        out = [model(x[:, :1], cache=cache, use_cache=True).logits]  # a first token through the step
        for a, b in pieces:
            out.append(model(x[:, a:b], cache=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(out, 1), full, atol=atol, rtol=0)
    return cache


def greedy(model, prompt, new_tokens: int):
    """`new_tokens` argmax continuations of prompt, each by a full uncached forward."""
    seq = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    return seq


def check_generate_equals_greedy(model, prompt, new_tokens: int, one_token_per_step: bool = False) -> None:
    """model.generate (greedy, cached) equals `greedy`; with one_token_per_step the embedding sees the prompt once
    and then exactly one token per step."""
    fed = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, inp, out: fed.append(inp[0].shape[1]))
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    hook.remove()
    if one_token_per_step:
        assert fed == [prompt.shape[1]] + [1] * (new_tokens - 1)
    assert torch.equal(generated, greedy(model, prompt, new_tokens))


def check_varlen_packed(model, tokens, lengths, *, leak_min: float = 1e-4, every_document: bool = True):
    """Documents of `lengths` (tokens seeds 10, 11, ...) packed with cu_seqlens equal each run alone (atol 1e-5);
    without cu_seqlens the state leaks across: every later document's logits move by more than leak_min
    (every_document) or the logits after the first document do (not every_document)."""
    docs = [tokens(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    packed = torch.cat(docs, dim=1)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    with torch.no_grad():
        out = model(packed, cu_seqlens=cu).logits
        singles = torch.cat([model(d, use_cache=False).logits for d in docs], dim=1)
        unpacked = model(packed, use_cache=False).logits
    torch.testing.assert_close(out, singles, atol=1e-5, rtol=0)
    if every_document:
        for s, e in zip(cu[1:-1].tolist(), cu[2:].tolist()):
            assert (unpacked[:, s:e] - out[:, s:e]).abs().max() > leak_min
    else:
        first = lengths[0]
        assert (unpacked[:, first:] - out[:, first:]).abs().max() > leak_min  # the boundaries matter
    return cu


def check_hybrid_decodes_and_packs(model, x, prompt: int = 6):
    """A hybrid model decodes x token by token after a prompt of `prompt` tokens equal to the full forward (1e-4),
    and packing [0, prompt, T] makes the second document equal to running it alone (1e-5). Returns the cache."""
    t = x.shape[1]
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        out = model(x[:, :prompt], use_cache=True)
        cache = out.get("cache", out.get("past_key_values"))
        steps = [out.logits] + [model(x[:, i:i + 1], cache=cache).logits for i in range(prompt, t)]
        packed = model(x, cu_seqlens=torch.tensor([0, prompt, t])).logits
        second = model(x[:, prompt:], use_cache=False).logits
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=0)
    torch.testing.assert_close(packed[:, prompt:], second, atol=1e-5, rtol=0)
    return cache


def check_save_load_round_trip(model, tmp_path, x, *, mixer: str | None = None, same_parameters: bool = True):
    """save_pretrained then AutoModelForCausalLM.from_pretrained gives a HiloForCausalLM (with config.mixer ==
    mixer when given), every parameter equal by name and value (same_parameters, same count), and logits on x
    bit-equal to the original's. Returns the loaded model."""
    from transformers import AutoModelForCausalLM

    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, HiloForCausalLM)
    if mixer is not None:
        assert loaded.config.mixer == mixer
    if same_parameters:
        for (n1, p1), (n2, p2) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
            assert n1 == n2 and torch.equal(p1, p2), n1
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    return loaded


def hilo_adamw(model):
    """training.optim.build_optimizer's AdamW (lr 3e-3, betas 0.9/0.95, weight decay 0.1 except embed/norm/bias)."""
    from omegaconf import OmegaConf

    from training.optim import build_optimizer

    optim_cfg = OmegaConf.create({"name": "adamw", "lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                  "weight_decay": 0.1, "no_decay": ["embed", "norm", "bias"], "fused": False})
    return build_optimizer(model, optim_cfg, on_cuda=False)


def train_on_fixed_batch(model, x, opt, steps: int, *, use_cache=False, check_first_grads: bool = False):
    """`steps` optimizer steps on labels = x; with check_first_grads every gradient of the first step is finite
    and non-zero. Returns the losses."""
    losses = []
    for step in range(steps):
        loss = model(x, labels=x).loss if use_cache is None else model(x, labels=x, use_cache=use_cache).loss
        opt.zero_grad()
        loss.backward()
        if check_first_grads and step == 0:
            assert_all_grads_finite_and_nonzero(model)
        opt.step()
        losses.append(loss.item())
    return losses


def check_training_lowers_loss(model, x, steps: int = 12) -> list:
    """`steps` hilo AdamW steps on a fixed batch bring the loss below 0.7 of the first. Returns the losses."""
    losses = train_on_fixed_batch(model, x, hilo_adamw(model), steps)
    assert losses[-1] < 0.7 * losses[0], losses
    return losses


def check_training_drops_loss_by(model, x, drop: float, steps: int = 8, check_first_grads: bool = False) -> list:
    """`steps` torch AdamW (lr 3e-3) steps on a fixed batch: every loss finite and the last below the first minus
    drop. Returns the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = train_on_fixed_batch(model, x, opt, steps, use_cache=None, check_first_grads=check_first_grads)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - drop, losses
    return losses


def check_model_flops(model, mixer, seq_len: int = 128) -> None:
    """num_flops_per_token = 6 x (linear weights) + 2 x the mixer's count per layer (two layers)."""
    n_lin = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert model.num_flops_per_token(seq_len) == 6 * n_lin + 2 * mixer.flops_per_token(seq_len)


# ---- configs and the command line ----------------------------------------------------------------------------


def compose(overrides):
    """The hydra `train` config of conf/ with the overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=overrides)


def preset_model(name: str, size: str):
    """conf/model/<name>.yaml with conf/model/size/<size>.yaml and vocab 1000, built on the meta device:
    (config, model)."""
    import yaml

    conf = REPO / "conf" / "model"
    cfg = {**yaml.safe_load((conf / f"{name}.yaml").read_text()),
           **yaml.safe_load((conf / "size" / f"{size}.yaml").read_text()), "vocab_size": 1000}
    config = build_config(cfg)
    with torch.device("meta"):
        model = HiloForCausalLM(config)
    return config, model


def check_parameter_count(model, config, mixer_params: int, vocab: int = 1000) -> None:
    """The model's parameters are num_layers x (mixer + SwiGLU MLP + two norms) + embeddings, head and final norm."""
    c = config.hidden_size
    block = mixer_params + 3 * c * config.intermediate_size + 2 * c
    expected = config.num_layers * block + 2 * vocab * c + c
    assert sum(p.numel() for p in model.parameters()) == expected


def run_train_py(tmp_path, overrides, steps: int, seq_len: int = 64) -> str:
    """train.py with the overrides for `steps` steps (tiny batch, no logger) exits 0 and its summary says the last
    step; returns the text of the saved checkpoint's config.json."""
    run_dir = tmp_path / "run"
    res = subprocess.run(
        [sys.executable, "train.py", *overrides, f"trainer.max_steps={steps}", "logger=none",
         f"trainer.seq_len={seq_len}", "trainer.batch_size=2", "trainer.val_batches=1",
         "trainer.progress_bar=false", f"hydra.run.dir={run_dir}"],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f'"step": {steps}' in (run_dir / "summary.json").read_text()
    return (run_dir / "checkpoints" / f"step_{steps:08d}" / "model" / "config.json").read_text()
