"""The kernels' HILO_* option readers take flags and integers strictly: a misspelt value is an error naming the
variable, the option and what it takes (it used to read as "off"), and 0 / false / no / off switch a flag off."""
import pytest

from kernels.common.env_options import parse_flag, parse_int


def test_parse_flag_and_int():
    assert [parse_flag("V", "k", w) for w in ("1", "True", " yes", "ON")] == [True] * 4
    assert [parse_flag("V", "k", w) for w in ("0", "false", "No", "off ")] == [False] * 4
    with pytest.raises(ValueError, match=r"V: k='maybe': expected 1 / true / yes / on or 0 / false / no / off"):
        parse_flag("V", "k", "maybe")
    assert parse_int("V", "k", " 32") == 32 and parse_int("V", "k", "-1") == -1
    with pytest.raises(ValueError, match=r"V: k='3x': expected an integer"):
        parse_int("V", "k", "3x")


@pytest.mark.parametrize("module,reader,var,spec,match,key,value", [
    ("kernels.hla.triton_fused", "_read_options", "HILO_HLA", "states16=maybe", "HILO_HLA: states16='maybe'",
     "states16", False),
    ("kernels.delta_rule.triton_fwd", "_apply_env_options", "HILO_DELTA_RULE", "fused_bwd=maybe",
     "HILO_DELTA_RULE: fused_bwd='maybe'", "fused_bwd", False),
    ("kernels.delta_rule.triton_fwd", "_apply_env_options", "HILO_DELTA_RULE", "state_bv_min=x",
     "HILO_DELTA_RULE: state_bv_min='x': expected an integer", "state_bv_min", 32),
    ("kernels.loglinear_attn.triton_fwd", "_apply_env_options", "HILO_LOGLINEAR", "lowp=maybe",
     "HILO_LOGLINEAR: lowp='maybe'", "lowp", False),
    ("kernels.loglinear_attn.triton_fwd", "_apply_env_options", "HILO_LOGLINEAR", "scan_warps=four",
     "HILO_LOGLINEAR: scan_warps='four': expected an integer", "scan_warps", 4),
])
def test_readers_reject_bad_values(monkeypatch, module, reader, var, spec, match, key, value):
    """Each reader names the bad value; the good spelling of the same option is read (flags: "off" is off)."""
    import importlib

    mod = importlib.import_module(module)
    monkeypatch.setattr(mod, "OPTIONS", dict(mod.OPTIONS))
    monkeypatch.setenv(var, spec)
    with pytest.raises(ValueError, match=match):
        getattr(mod, reader)()
    good = "off" if value is False else str(value)
    monkeypatch.setenv(var, f"{key}={good}")
    getattr(mod, reader)()
    assert mod.OPTIONS[key] == value
