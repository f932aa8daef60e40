import itertools
import math

import pytest
import torch
from omegaconf import OmegaConf

from training import build_lr_schedule, build_optimizer, lr_multiplier, split_decay_groups


def _kw(**over):
    kw = {"total_steps": 100, "schedule": "cosine", "warmup_steps": 10, "min_lr_ratio": 0.1, "decay_fraction": 0.2}
    kw.update(over)
    return kw


def test_warmup_is_linear_then_cosine_reaches_min():
    assert lr_multiplier(0, **_kw()) == pytest.approx(0.1)
    assert lr_multiplier(9, **_kw()) == pytest.approx(1.0)
    assert lr_multiplier(10, **_kw()) == pytest.approx(1.0)
    # halfway through the cosine part the factor is the mean of 1 and min_lr_ratio
    assert lr_multiplier(55, **_kw()) == pytest.approx(0.55)
    assert lr_multiplier(100, **_kw()) == pytest.approx(0.1)
    values = [lr_multiplier(s, **_kw()) for s in range(10, 101)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_wsd_is_flat_then_decays_linearly_over_the_last_fraction():
    kw = _kw(schedule="wsd")
    assert [lr_multiplier(s, **kw) for s in (10, 50, 79)] == [1.0, 1.0, 1.0]
    assert lr_multiplier(90, **kw) == pytest.approx(1 - 0.9 * 0.5)
    assert lr_multiplier(100, **kw) == pytest.approx(0.1)


def test_constant_and_bad_schedule():
    assert lr_multiplier(70, **_kw(schedule="constant")) == 1.0
    with pytest.raises(ValueError, match="cosine, wsd or constant"):
        lr_multiplier(70, **_kw(schedule="linear"))


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(10, 4)
        self.proj = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.A_log = torch.nn.Parameter(torch.zeros(3))
        self.level_param = torch.nn.Parameter(torch.ones(3, 5))
        self.level_param._no_weight_decay = True


def test_no_decay_groups():
    model = _Toy()
    decay, no_decay = split_decay_groups(model, ["embed", "norm"])
    ids = lambda ps: {id(p) for p in ps}
    assert ids(decay) == {id(model.proj.weight)}
    assert ids(no_decay) == {id(model.embed_tokens.weight), id(model.proj.bias), id(model.norm.weight),
                             id(model.norm.bias), id(model.A_log), id(model.level_param)}


def test_scheduler_steps_once_per_call():
    model = _Toy()
    cfg = OmegaConf.create({"name": "adamw", "lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                            "no_decay": ["embed", "norm"], "fused": "auto", "schedule": "cosine", "warmup_steps": 4,
                            "min_lr_ratio": 0.1, "decay_fraction": 0.2})
    opt = build_optimizer(model, cfg, on_cuda=False)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    sched = build_lr_schedule(opt, cfg, total_steps=20)
    lrs = []
    for _ in range(20):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    expected = [1e-2 * lr_multiplier(s, total_steps=20, schedule="cosine", warmup_steps=4, min_lr_ratio=0.1,
                                     decay_fraction=0.2) for s in range(20)]
    assert lrs == pytest.approx(expected)
    assert math.isclose(lrs[3], 1e-2)


def test_frozen_parameters_keep_their_values_and_take_no_gradient():
    """optim.frozen: matched parameters get no gradient and no update (weight decay included); the rest train."""
    from models import build_model

    torch.manual_seed(0)
    model = build_model({"mixer": "loglinear_gated_deltanet", "hidden_size": 32, "num_layers": 2, "vocab_size": 64,
                         "num_heads": 1, "max_position_embeddings": 64, "mixer_kwargs": {"num_heads": 1, "head_dim": 16}})
    cfg = OmegaConf.create({"name": "adamw", "lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                            "no_decay": ["norm"], "fused": False, "frozen": ["*.mixer.L", "*.l_proj.weight"]})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, cfg, on_cuda=False)
    ids = torch.randint(0, 64, (2, 40))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    frozen = [n for n in before if n.endswith((".mixer.L", ".l_proj.weight"))]
    assert len(frozen) == 4
    for name, p in model.named_parameters():
        if name in frozen:
            assert not p.requires_grad and p.grad is None and torch.equal(p, before[name]), name
    assert not torch.equal(model.model.layers[0].mixer.q_proj.weight, before["model.layers.0.mixer.q_proj.weight"])


def test_frozen_patterns_that_match_nothing_or_everything_are_errors():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    base = {"name": "adamw", "lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0, "no_decay": [],
            "fused": False}
    with pytest.raises(ValueError, match=r"'\*\.L' matches no parameter"):
        build_optimizer(model, OmegaConf.create({**base, "frozen": ["*.L"]}), on_cuda=False)
    with pytest.raises(ValueError, match="nothing is left to train"):
        build_optimizer(model, OmegaConf.create({**base, "frozen": ["*"]}), on_cuda=False)
