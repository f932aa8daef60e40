"""Every config in conf/ composes, and bad values are refused with the key, the value and the fix."""
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from training import ConfigError, validate_train_config

CONF = Path(__file__).resolve().parents[2] / "conf"
GROUPS = ["model", "model/size", "data", "tokenizer", "optim", "trainer", "logger", "eval", "experiment"]


def _options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _compose(overrides, config_name="train"):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides, return_hydra_config=False)


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_of_every_group_composes(group):
    options = _options(group)
    if group != "experiment":
        assert options, f"conf/{group} has no options"
    for option in options:
        cfg = _compose([f"{group}={option}"])
        OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
        validate_train_config(cfg)


def test_eval_config_composes():
    cfg = _compose(["checkpoint=runs/x"], config_name="eval")
    assert cfg.eval.suite == "ppl_by_position"


@pytest.mark.parametrize("name", ["ddp", "fsdp", "cpu"])
def test_accelerate_configs_parse(name):
    conf = yaml.safe_load((CONF / "accelerate" / f"{name}.yaml").read_text())
    assert conf["num_processes"] >= 2
    assert conf["distributed_type"] in {"MULTI_GPU", "FSDP", "MULTI_CPU"}


def test_model_and_size_overrides_land_in_model():
    cfg = _compose(["model=transformer", "model/size=340m", "trainer.seq_len=16384"])
    assert cfg.model.hidden_size == 1024 and cfg.model.num_layers == 24
    assert cfg.name == "transformer-340m-pydocs-T16384"


@pytest.mark.parametrize("override, key", [
    ("trainer.max_steps=abc", "trainer.max_steps"),
    ("trainer.batch_size=0", "trainer.batch_size"),
    ("optim.lr=-1", "optim.lr"),
    ("optim.schedule=linear", "optim.schedule"),
    ("trainer.mixed_precision=fp8", "trainer.mixed_precision"),
])
def test_bad_values_name_the_key(override, key):
    cfg = _compose([override])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_train_config(cfg)


def test_unknown_model_option_is_a_clear_error():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="transformer"):  # Hydra lists the available options
        _compose(["model=no_such_model"])


def test_fsdp_precision_policy_reduces_in_fp32(monkeypatch):
    """Under an FSDP launch the trainer hands accelerate a plugin whose gradients reduce in fp32 and whose parameters
    are gathered in fp32 (or bf16 with trainer.fsdp_param_dtype=bf16); elsewhere it hands none."""
    import torch

    from training.trainer import fsdp_plugin

    tr = _compose([]).trainer
    assert tr.fsdp_param_dtype == "fp32"
    assert fsdp_plugin(tr, "bf16", use_cpu=False) is None  # not under an FSDP launch
    for key, value in {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
                       "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
                       "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block"}.items():
        monkeypatch.setenv(key, value)
    policy = fsdp_plugin(tr, "bf16", use_cpu=False).mixed_precision_policy
    assert policy.param_dtype is None and policy.reduce_dtype == torch.float32
    tr.fsdp_param_dtype = "bf16"
    assert fsdp_plugin(tr, "bf16", use_cpu=False).mixed_precision_policy.param_dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="fsdp_param_dtype"):
        validate_train_config(_compose(["trainer.fsdp_param_dtype=fp16"]))


@pytest.mark.parametrize("override, message", [
    ("+trainer.max_step=2", r"trainer\.max_step is not a setting \(did you mean trainer\.max_steps\?\)"),
    ("+optim.warmup=10", r"optim\.warmup is not a setting \(did you mean optim\.warmup_steps\?\)"),
])
def test_a_typo_behind_plus_is_refused_with_the_near_key(override, message):
    with pytest.raises(ConfigError, match=message):
        validate_train_config(_compose([override]))
    validate_train_config(_compose(["trainer.max_steps=2"]))  # the real keys pass
