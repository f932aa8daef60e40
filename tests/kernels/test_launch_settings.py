"""hilo_kernels.common.launch: the launch-settings table of every kernel family, launch_settings (the one override) and the
head-size rules that read it (docs/kernel_settings.md)."""

import dataclasses
import threading

import pytest
import torch

from hilo_kernels.common import launch_settings
from hilo_kernels.common.launch import FAMILIES, current, defaults, hla_cols


def test_every_family_launches_with_its_defaults():
    """Outside any override every family's settings are its table's defaults, and the table holds the shipped
    values the kernels were timed with."""
    assert sorted(FAMILIES) == ["delta_rule", "hla", "linear_attn", "loglinear_attn", "loglinear_delta_rule",
                                "short_conv"]
    for family in FAMILIES:
        assert current(family) == defaults(family)
    assert (defaults("delta_rule").grads_warps, defaults("delta_rule").state_bwd_warps) == (4, 8)
    assert (defaults("linear_attn").state_stages, defaults("linear_attn").bwd_warps) == (3, 4)
    assert (defaults("hla").dqk_bk, defaults("hla").out_bk) == (64, 128)
    assert (defaults("loglinear_delta_rule").scan_levels, defaults("loglinear_attn").node_stages) == (8, 2)


def test_override_applies_inside_and_is_restored_after():
    """Only the named settings change, only inside the block; nested blocks stack; an exception inside still
    restores the settings."""
    with launch_settings(delta_rule={"state_warps": 8}, linear_attn={"bwd_warps": 8, "bwd_maxnreg": 128}):
        assert current("delta_rule").state_warps == 8
        assert current("delta_rule").state_bwd_warps == 8  # its default, untouched
        assert (current("linear_attn").bwd_warps, current("linear_attn").bwd_maxnreg) == (8, 128)
        with launch_settings(delta_rule={"state_warps": 2, "wide_stages": 1}):
            assert (current("delta_rule").state_warps, current("delta_rule").wide_stages) == (2, 1)
            assert current("linear_attn").bwd_warps == 8
        assert (current("delta_rule").state_warps, current("delta_rule").wide_stages) == (8, 2)
    assert current("delta_rule") == defaults("delta_rule") and current("linear_attn") == defaults("linear_attn")
    with pytest.raises(RuntimeError, match="inside"), launch_settings(hla={"out_warps": 2}):
        assert current("hla").out_warps == 2
        raise RuntimeError("inside")
    assert current("hla") == defaults("hla")


def test_override_is_seen_by_other_threads():
    """The settings are process-wide: a thread launching inside the block sees the override."""
    seen = []
    with launch_settings(short_conv={"block_t": 32}):
        worker = threading.Thread(target=lambda: seen.append(current("short_conv").block_t))
        worker.start()
        worker.join()
    assert seen == [32] and current("short_conv").block_t == 64


def test_bad_names_and_values_are_clear_errors():
    """An unknown family or setting names the valid ones; a value of the wrong type (a bool for a warp count, None
    where no rule stands behind the setting) names the expected type; nothing is changed by a refused call."""
    family = r"unknown kernel family 'delta'; expected one of \['delta_rule', 'hla',"
    with pytest.raises(ValueError, match=family), launch_settings(delta={"state_warps": 8}):
        pass
    setting = r"delta_rule: unknown launch setting 'warps'; expected one of .*'grads_bv'"
    with pytest.raises(ValueError, match=setting), launch_settings(delta_rule={"warps": 8}):
        pass
    for bad in ({"state_warps": True}, {"state_warps": None}, {"state_warps": 4.0}, {"grads_maxnreg": "128"}):
        with pytest.raises(ValueError, match="expected"), launch_settings(delta_rule=bad):
            pass
    # every name is checked before anything is applied
    with pytest.raises(ValueError, match="unknown launch setting"), launch_settings(linear_attn={"bwd_warps": 8},
                                                                                    delta_rule={"nope": 1}):
        pass
    assert current("linear_attn") == defaults("linear_attn")
    with pytest.raises(ValueError, match="unknown kernel family"):
        current("flash")
    with pytest.raises(dataclasses.FrozenInstanceError):
        current("hla").out_warps = 8  # the table is changed only through launch_settings


def test_short_conv_tiles_follow_the_table():
    """short_conv's tiles: 64x64 at 4 warps without an initial state, 32x64 with one; the settings override them."""
    from hilo_kernels.short_conv.triton import tiles

    assert (tiles(False), tiles(True)) == ((64, 64, 4), (32, 64, 4))
    with launch_settings(short_conv={"block_t": 128, "block_c": 32, "warps": 8}):
        assert (tiles(False), tiles(True)) == ((128, 32, 8), (32, 64, 4))


def test_hla_output_columns_rule():
    """hla's chunk kernels take 64 output columns up to K = 128 and 32 past it; each setting wins at any K."""
    assert [hla_cols(dk) for dk in (64, 128, 129, 256)] == [(64, 64), (64, 64), (32, 32), (32, 32)]
    with launch_settings(hla={"dvalues_bv": 16}):
        assert hla_cols(256) == (32, 16) and hla_cols(64) == (64, 16)


def test_loglinear_delta_glue_option(monkeypatch):
    """HILO_LOGLINEAR_DELTA_GLUE (read at each call): auto compiles the glue for CUDA tensors only; eager and
    compiled force it; anything else is an error naming the choices."""
    from hilo_kernels.loglinear_delta_rule.triton_bwd import glue_mode

    monkeypatch.delenv("HILO_LOGLINEAR_DELTA_GLUE", raising=False)
    assert (glue_mode(True), glue_mode(False)) == ("compiled", "eager")
    monkeypatch.setenv("HILO_LOGLINEAR_DELTA_GLUE", "eager")
    assert glue_mode(True) == "eager"
    monkeypatch.setenv("HILO_LOGLINEAR_DELTA_GLUE", "compiled")
    assert glue_mode(False) == "compiled"
    monkeypatch.setenv("HILO_LOGLINEAR_DELTA_GLUE", "jit")
    with pytest.raises(ValueError, match=r"HILO_LOGLINEAR_DELTA_GLUE='jit': expected one of \('auto', 'eager'"):
        glue_mode(True)


def test_delta_rule_state_passes_launch_with_the_settings(monkeypatch):
    """The kernels read the settings at launch: delta_rule's state passes launch with the overridden warps inside
    the block and with the defaults after it (recorded; the launch itself runs as usual)."""
    from hilo_kernels.delta_rule import delta_rule, triton_fwd

    seen = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs["num_warps"])
                return self.kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_fwd, "_state_kernel", Recorder(triton_fwd._state_kernel))
    gen = torch.Generator().manual_seed(3)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (torch.randn(1, 20, 1, 16, generator=gen).to(dev) for _ in range(3))
    k = torch.nn.functional.normalize(k, dim=-1)
    beta = torch.rand(1, 20, 1, generator=gen).to(dev)
    with launch_settings(delta_rule={"state_warps": 2}):
        delta_rule(q, k, v, beta=beta, backend="triton")
    delta_rule(q, k, v, beta=beta, backend="triton")
    assert seen == [2, 4]
