"""RULER's string_match_all: the fraction of a sample's reference answers found in its prediction."""
from __future__ import annotations

import re
from collections.abc import Sequence

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """RULER's clean-up of a generation: control characters become newlines, outer whitespace is stripped."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction (0..1) of ``references`` that occur in ``prediction``, case-insensitively."""
    if not references:
        raise ValueError("string_match_all needs at least one reference answer")
    text = postprocess(prediction).lower()
    return sum(ref.lower() in text for ref in references) / len(references)
