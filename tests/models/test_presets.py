"""conf/model presets: every size composes with transformer.yaml into a HiloConfig of the named size."""

from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from models import HiloForCausalLM, build_config

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"
VOCAB = 32000
NOMINAL = {"tiny": None, "125m": 125e6, "340m": 340e6, "760m": 760e6, "1.3b": 1.3e9}


def compose(size: str) -> dict:
    base = yaml.safe_load((CONF / "transformer.yaml").read_text())
    text = (CONF / "size" / f"{size}.yaml").read_text()
    assert text.startswith("# @package model")
    return {**base, **yaml.safe_load(text), "vocab_size": VOCAB}


def analytic_params(c) -> int:
    """Parameters written out from the architecture, independent of the module code."""
    attn = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    norms = 2 * c.hidden_size
    head = 0 if c.tie_word_embeddings else VOCAB * c.hidden_size
    return c.num_layers * (attn + mlp + norms) + VOCAB * c.hidden_size + c.hidden_size + head


@pytest.mark.parametrize("size", list(NOMINAL))
def test_size_presets_build_with_expected_parameter_count(size):
    cfg = compose(size)
    assert cfg["size_name"] == size
    config = build_config(cfg)
    assert config.mixer == "attention" and config.attn_layers == []
    assert config.hidden_size % 128 == 0 and config.intermediate_size % 256 == 0
    with torch.device("meta"):
        model = HiloForCausalLM(config)  # meta: no memory even for 1.3b
    n = sum(p.numel() for p in model.parameters())
    assert n == analytic_params(config)
    if NOMINAL[size] is not None:
        assert 0.7 * NOMINAL[size] <= n <= 1.35 * NOMINAL[size], f"{size}: {n / 1e6:.0f}M parameters"
    assert model.num_flops_per_token(2048) > 6 * (n - VOCAB * config.hidden_size) - 1


def test_preset_shapes():
    shapes = {s: build_config(compose(s)) for s in NOMINAL}
    assert [(c.hidden_size, c.num_layers, c.num_heads, c.head_dim) for c in shapes.values()] == [
        (128, 4, 4, 32), (768, 12, 12, 64), (1024, 24, 16, 64), (1536, 21, 12, 128), (2048, 24, 16, 128)
    ]


def test_tiny_preset_runs_forward():
    torch.manual_seed(0)
    model = HiloForCausalLM(build_config({**compose("tiny"), "vocab_size": 101}))
    x = torch.randint(0, 101, (1, 16))
    assert torch.isfinite(model(x, labels=x).loss)
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == 4 * 6 + 1
