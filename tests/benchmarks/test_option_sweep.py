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


def test_sweep_loop_checks_and_times_each_variant_under_its_options(monkeypatch, capsys):
    """main() with the GPU parts stubbed (the check, the timed calls, CUDA itself): each variant is checked and timed
    with its own options in force and the defaults back afterwards; the table gets the worst quantity, the log every
    quantity; a failed check is a non-zero exit."""
    import torch
    import triton.testing

    from benchmarks import kernels as kb
    from benchmarks import option_sweep
    from kernels.linear_attn import triton_fwd

    for var in READERS:
        monkeypatch.delenv(var, raising=False)
    seen = []

    def fake_check(name, case, device):
        seen.append(triton_fwd.OPTIONS["state_segments"])
        ratio = 9e-3 if seen[-1] == 8 else 2e-3  # the 8-segment variant fails its bound
        return [("T=777", "o", ratio, 5e-3), ("T=777", "dg", 1e-3, 2e-2), ("T=777 (torch)", "o", 1.0, 5e-3)]

    noop = lambda *a, **k: None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", noop)
    monkeypatch.setattr(torch.cuda, "empty_cache", noop)
    monkeypatch.setattr(kb, "check", fake_check)
    monkeypatch.setattr(kb, "_op_fn", lambda *a, **k: (noop, noop, []))
    monkeypatch.setattr(triton.testing, "do_bench", lambda *a, **k: 1.25)
    rc = option_sweep.main(["--op", "linear_attn", "--variants", "", "HILO_LINEAR_ATTN=state_segments=2",
                            "HILO_LINEAR_ATTN=state_segments=8"])
    out = capsys.readouterr().out
    assert seen == [0, 2, 8] and triton_fwd.OPTIONS["state_segments"] == 0 and rc == 1
    assert "  HILO_LINEAR_ATTN=state_segments=2: T=777 o 2.00e-03; T=777 dg 1.00e-03" in out
    assert "| `(defaults)` | ok (o 2.00e-03 / 0.005) | 1.250 | 1.250 |" in out
    assert "| `HILO_LINEAR_ATTN=state_segments=8` | FAIL: T=777 o 9.00e-03 > 0.005 (o 9.00e-03 / 0.005)" in out


def test_rounds_time_every_variant_round_after_round(monkeypatch, capsys):
    """--rounds 3: each variant checked once, then timed in three rounds that alternate the variants; the table gives
    each variant's median over its rounds and every round's fwd+bwd; --rounds 0 is refused."""
    import torch
    import triton.testing

    from benchmarks import kernels as kb
    from benchmarks import option_sweep
    from kernels.linear_attn import triton_fwd

    for var in READERS:
        monkeypatch.delenv(var, raising=False)
    checked, timed = [], []

    def fake_bench(fn, *a, **k):
        warps = triton_fwd.OPTIONS["bwd_warps"]
        timed.append(warps)
        n = len(timed)  # fwd, fwd+bwd alternate; the variant with 4 warps is 0.5 ms faster in each round
        return (1.0 if n % 2 else 2.0 + 0.1 * (n // 4)) - (0.5 if warps == 4 else 0.0)

    noop = lambda *a, **k: None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", noop)
    monkeypatch.setattr(torch.cuda, "empty_cache", noop)
    monkeypatch.setattr(kb, "check", lambda *a, **k: checked.append(1) or [("T=777", "o", 1e-3, 5e-3)])
    monkeypatch.setattr(kb, "_op_fn", lambda *a, **k: (noop, noop, []))
    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    rc = option_sweep.main(["--op", "linear_attn", "--rounds", "3", "--variants", "", "HILO_LINEAR_ATTN=bwd_warps=4"])
    out = capsys.readouterr().out
    assert rc == 0 and len(checked) == 2 and timed == [0, 0, 4, 4] * 3
    # fwd+bwd are do_bench's calls n = 2, 4, ..., 12: 2.0 + 0.1 * (n // 4), less 0.5 for 4 warps (n = 4, 8, 12)
    assert "| `(defaults)` | ok (o 1.00e-03 / 0.005) | 1.000 | 2.100 | 0 | 2.000 / 2.100 / 2.200 |" in out
    assert ("| `HILO_LINEAR_ATTN=bwd_warps=4` | ok (o 1.00e-03 / 0.005) | 0.500 | 1.700 | 0 | 1.600 / 1.700 / 1.800 |"
            in out)
    assert "  round 2 HILO_LINEAR_ATTN=bwd_warps=4: fwd 0.500 fwd+bwd 1.700" in out
    with pytest.raises(SystemExit, match="--rounds 0"):
        option_sweep.main(["--op", "linear_attn", "--rounds", "0", "--variants", ""])
