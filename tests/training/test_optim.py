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
