"""benchmarks/option_sweep.py without a GPU: variant parsing, and each variant starting from the defaults (the
OPTIONS dicts restored, then the environment's spec applied by the module's own reader)."""
import os

import pytest

from benchmarks.option_sweep import READERS, OptionState, parse_variant


def test_parse_variant():
    assert parse_variant("") == {}
    assert parse_variant("HILO_LOGLINEAR=scan_cols=64,scan_levels=4; HILO_LOGLINEAR_DELTA=glue=eager") == {
        "HILO_LOGLINEAR": "scan_cols=64,scan_levels=4", "HILO_LOGLINEAR_DELTA": "glue=eager"}
    for bad in ("HILO_NOPE=x=1", "scan_cols=64", "HILO_HLA"):
        with pytest.raises(SystemExit, match="expected VAR=spec with VAR one of"):
            parse_variant(bad)


def test_each_variant_starts_from_the_defaults(monkeypatch):
    for var in READERS:
        monkeypatch.delenv(var, raising=False)
    state = OptionState()
    attn, delta = state.modules["HILO_LOGLINEAR"], state.modules["HILO_LOGLINEAR_DELTA"]
    defaults = dict(attn.OPTIONS), dict(delta.OPTIONS)
    try:
        state.apply(parse_variant("HILO_LOGLINEAR=scan_cols=64,scan_levels=4;HILO_LOGLINEAR_DELTA=glue=eager"))
        assert (attn.OPTIONS["scan_cols"], attn.OPTIONS["scan_levels"], delta.OPTIONS["glue"]) == (64, 4, "eager")
        state.apply(parse_variant("HILO_LOGLINEAR_DELTA=glue_tf32=0"))  # the previous variant's settings are gone
        assert attn.OPTIONS == defaults[0]
        assert delta.OPTIONS == {**defaults[1], "glue_tf32": "0"}
        with pytest.raises(ValueError, match="HILO_LOGLINEAR_DELTA"):
            state.apply(parse_variant("HILO_LOGLINEAR_DELTA=glue=jit"))
    finally:
        state.apply({})
        for var in READERS:
            os.environ.pop(var, None)
    assert (dict(attn.OPTIONS), dict(delta.OPTIONS)) == defaults
