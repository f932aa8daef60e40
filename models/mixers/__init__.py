"""Sequence mixers; importing this package registers every mixer in models.registry.MIXERS."""

from models.mixers.attention import AttentionMixer
from models.mixers.gated_deltanet import GatedDeltaNetMixer
from models.mixers.hla import HLAMixer
from models.mixers.hla_gated_deltanet import HLAGatedDeltaNetMixer
from models.mixers.hla_mamba2 import HLAMamba2Mixer
from models.mixers.loglinear_gated_deltanet import LogLinearGatedDeltaNetMixer
from models.mixers.loglinear_mamba2 import LogLinearMamba2Mixer
from models.mixers.mamba2 import Mamba2Mixer

__all__ = ["AttentionMixer", "GatedDeltaNetMixer", "HLAGatedDeltaNetMixer", "HLAMamba2Mixer", "HLAMixer",
           "LogLinearGatedDeltaNetMixer", "LogLinearMamba2Mixer", "Mamba2Mixer"]
