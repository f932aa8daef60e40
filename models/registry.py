"""Mixer registry: config names -> mixer classes.

A mixer is built as Mixer(config, layer_idx) and called as
mixer(hidden [B, T, C], position_ids [B, T], cu_seqlens [N+1] or None, cache HiloCache or None) -> [B, T, C].
It also reports mixer.flops_per_token(seq_len): its training FLOPs per token beyond 6 x its matmul
parameters (the sequence-mixing part: attention scores, scans, ...).
"""

from torch import nn

MIXERS: dict[str, type[nn.Module]] = {}


def register_mixer(name: str):
    """Class decorator registering a mixer under name (the value of config.mixer)."""

    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        existing = MIXERS.get(name)
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise ValueError(f"mixer {name!r} is already registered to {existing.__module__}.{existing.__qualname__}")
        MIXERS[name] = cls
        return cls

    return wrap


def check_mixer(name: str) -> None:
    """Raise ValueError listing the registered mixers when name is not one of them."""
    if name not in MIXERS:
        raise ValueError(f"unknown mixer {name!r}; registered mixers: {sorted(MIXERS)}")


def build_mixer(name: str, config, layer_idx: int) -> nn.Module:
    """Instantiate the mixer registered as name for layer layer_idx."""
    check_mixer(name)
    return MIXERS[name](config, layer_idx)


def mixer_options(name: str, mixer_kwargs: dict, defaults: dict) -> dict:
    """defaults updated with mixer_kwargs (config.mixer_kwargs); raise ValueError naming unknown keys."""
    unknown = sorted(set(mixer_kwargs) - set(defaults))
    if unknown:
        raise ValueError(f"unknown mixer_kwargs {unknown} for mixer {name!r}; valid keys: {sorted(defaults)}")
    return {**defaults, **mixer_kwargs}
