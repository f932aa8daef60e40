"""Sequence mixers; importing this package registers every mixer in models.registry.MIXERS."""

from models.mixers.attention import AttentionMixer

__all__ = ["AttentionMixer"]
