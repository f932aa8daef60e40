"""The bf16 check's HLA cases (hilo_kernels/common/checks.py, which benchmarks/operators.py times) on CPU: each builds the
op's inputs with an initial state of all its fields side by side and returns (o, the final state's fields side by
side), equal to calling the operator directly; hla3 (three state fields) included. And operators.py's profile."""
import pytest
import torch

from benchmarks import operators as kb
from hilo_kernels.common.checks import CASES
from hilo_kernels.hla.state import STATE_TYPES


@pytest.mark.parametrize("op,fields", [("hla2", 2), ("ahla", 2), ("hla3", 3)])
def test_hla_cases_pack_every_state_field(op, fields):
    import hilo_kernels

    x = CASES[op].make(1, 20, 2, 8, "cpu", seed=3, n_state=1)
    assert x["initial_state"].shape == (1, 2, 8, fields * 8)
    o, state = CASES[op].call(x, None, "torch")
    h0 = STATE_TYPES[op](*x["initial_state"].split(8, dim=-1))
    o_ref, st_ref = getattr(hilo_kernels, op)(x["q"], x["k"], x["v"], g=x["g"], initial_state=h0, output_final_state=True,
                                         backend="torch")
    assert torch.equal(o, o_ref) and torch.equal(state, torch.cat(list(st_ref), dim=-1))
    assert CASES["hla3"].backend == "triton"  # no fused kernel: the composition is what runs on CUDA


def test_profile_gives_every_call_fresh_gradients(monkeypatch, capsys):
    """operators.py --profile times forward + backward calls with the inputs' gradients reset before each (as
    do_bench's grad_to_none), so no gradient-accumulation kernels are counted as the op's."""
    import torch.profiler

    leaves = [torch.zeros(3, requires_grad=True) for _ in range(2)]
    calls = []

    def step():
        calls.append(all(x.grad is None for x in leaves))
        for x in leaves:
            x.grad = torch.ones(3)

    class FakeProfile:  # torch.profiler.profile's context manager, recording nothing
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def key_averages(self):
            class Table(list):
                def table(self, **k):
                    return "(table)"
            return Table()

    monkeypatch.setattr(kb, "_op_fn", lambda *a, **k: (None, step, leaves))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.profiler, "profile", lambda *a, **k: FakeProfile())
    kb.profile(["linear_attn"], 64, 128, 2, 16, "cpu")
    assert len(calls) == 13 and all(calls), calls
    assert "linear_attn T=64 B=2" in capsys.readouterr().out


def test_settings_sweep_every_combination_under_its_launch_settings(monkeypatch, capsys):
    """--settings FAMILY.SETTING=V1,V2 ...: every combination of the values, in order, each run with its launch
    settings in effect (and the defaults back after), its rows labelled with it; bad specs fail before anything
    runs, naming the problem."""
    from hilo_kernels.common import launch

    combos = kb.parse_settings(["delta_rule.grads_warps=4,8", "delta_rule.grads_maxnreg=none,128",
                                "hla.out_warps=8"])
    assert combos == [{"delta_rule": {"grads_warps": w, "grads_maxnreg": r}, "hla": {"out_warps": 8}}
                      for w in (4, 8) for r in (None, 128)]
    assert kb.settings_label(combos[3]) == "grads_warps=8 grads_maxnreg=128 out_warps=8"
    assert kb.parse_settings([]) == [{}] and kb.settings_label({}) == ""
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kb, "run", lambda args, device, tag, sdpa: seen.append(
        (tag, launch.current("delta_rule").grads_warps, launch.current("delta_rule").grads_stages, sdpa)) or False)
    assert kb.main(["--ops", "delta_rule", "--settings", "delta_rule.grads_warps=8,2", "delta_rule.grads_stages=1"]) == 0
    # SDPA's rows (no hilo settings) are timed with the first combination only
    assert seen == [("grads_warps=8 grads_stages=1", 8, 1, True), ("grads_warps=2 grads_stages=1", 2, 1, False)]
    assert launch.current("delta_rule") == launch.defaults("delta_rule")
    assert "## launch settings: grads_warps=2 grads_stages=1" in capsys.readouterr().out
    for bad, message in ((["delta_rule.grads_warps"], "expected FAMILY.SETTING=V1"),
                         (["grads_warps=4"], "expected FAMILY.SETTING=V1"),
                         (["delta_rule.grads_warps=four"], "expected an integer"),
                         (["delta_rule.grads_warps=4", "delta_rule.grads_warps=8"], "given twice"),
                         (["delta_rule.no_such_setting=4"], "no_such_setting"),
                         (["no_such_family.x=4"], "no_such_family")):
        with pytest.raises(SystemExit):
            kb.main(["--ops", "delta_rule", "--settings", *bad])
        assert message in capsys.readouterr().err, bad
