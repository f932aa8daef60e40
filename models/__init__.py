"""hilo models: HiloConfig, HiloForCausalLM and the mixer registry.

Importing this package registers model_type "hilo" with AutoConfig and AutoModelForCausalLM, so
AutoModelForCausalLM.from_pretrained(dir) loads a saved hilo model.
"""

from collections.abc import Mapping

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from models import mixers  # noqa: F401  (registers the built-in mixers)
from models.blocks import Block
from models.cache import HiloCache
from models.config import CONFIG_KEYS, HiloConfig
from models.lm import HiloForCausalLM, HiloModel, HiloPreTrainedModel
from models.registry import MIXERS, build_mixer, check_mixer, register_mixer

# Keys of conf/model/*.yaml that name runs but are not architecture.
HYDRA_ONLY_KEYS = ("name", "size_name")

AutoConfig.register("hilo", HiloConfig, exist_ok=True)
AutoModel.register(HiloConfig, HiloModel, exist_ok=True)
AutoModelForCausalLM.register(HiloConfig, HiloForCausalLM, exist_ok=True)

__all__ = [
    "MIXERS", "Block", "HiloCache", "HiloConfig", "HiloForCausalLM", "HiloModel", "HiloPreTrainedModel",
    "build_config", "build_mixer", "build_model", "register_mixer",
]


def build_config(cfg: Mapping) -> HiloConfig:
    """HiloConfig from a model config dict (Hydra's model group, plus vocab_size).

    The Hydra-only keys `name` and `size_name` (used to name runs) are ignored.

    Raises ValueError naming an unknown key (and listing the valid ones) or an unknown mixer (listing the
    registered ones).
    """
    cfg = {k: v for k, v in dict(cfg).items() if k not in HYDRA_ONLY_KEYS}
    unknown = sorted(set(cfg) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"unknown model config key(s) {unknown}; valid keys: {sorted(CONFIG_KEYS)}")
    check_mixer(cfg.get("mixer", "attention"))
    return HiloConfig(**cfg)


def build_model(cfg: Mapping) -> HiloForCausalLM:
    """HiloForCausalLM built from a model config dict (see build_config), freshly initialized."""
    return HiloForCausalLM(build_config(cfg))
