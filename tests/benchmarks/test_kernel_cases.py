"""The bf16 check's HLA cases (kernels/common/checks.py, which benchmarks/kernels.py times) on CPU: each builds the
op's inputs with an initial state of all its fields side by side and returns (o, the final state's fields side by
side), equal to calling the operator directly; hla3 (three state fields) included. And kernels.py's profile."""
import pytest
import torch

from benchmarks import kernels as kb
from kernels.common.checks import CASES
from kernels.hla.state import STATE_TYPES


@pytest.mark.parametrize("op,fields", [("hla2", 2), ("ahla", 2), ("hla3", 3)])
def test_hla_cases_pack_every_state_field(op, fields):
    import kernels

    x = CASES[op].make(1, 20, 2, 8, "cpu", seed=3, n_state=1)
    assert x["initial_state"].shape == (1, 2, 8, fields * 8)
    o, state = CASES[op].call(x, None, "torch")
    h0 = STATE_TYPES[op](*x["initial_state"].split(8, dim=-1))
    o_ref, st_ref = getattr(kernels, op)(x["q"], x["k"], x["v"], g=x["g"], initial_state=h0, output_final_state=True,
                                         backend="torch")
    assert torch.equal(o, o_ref) and torch.equal(state, torch.cat(list(st_ref), dim=-1))
    assert CASES["hla3"].backend == "triton"  # no fused kernel: the composition is what runs on CUDA


def test_profile_gives_every_call_fresh_gradients(monkeypatch, capsys):
    """kernels.py --profile times forward + backward calls with the inputs' gradients reset before each (as
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
