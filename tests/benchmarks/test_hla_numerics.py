"""benchmarks/hla_numerics.py on CPU at tiny shapes (T = 130, H = 2, D = 16, backend "torch").

Every configuration must be measured once; magnitudes must be those of the masked-matrix definition
(hilo_kernels.hla.hla_masked, float64) on the same inputs; fp32 against itself must give error ratios of exactly 0.
"""
import json
import math

import pytest
import torch

from benchmarks import hla_numerics
from benchmarks.hla_numerics import OPS, bands, make_inputs, measure
from hilo_kernels.hla import hla_masked

T, H, D = 130, 2, 16
TINY = ["--device", "cpu", "--seq-len", str(T), "--heads", str(H), "--dim", str(D)]
DECAYS = ("none", "0.999", "0.99", "0.9")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Every op, decay and normalize through the CLI: (rows, the JSON it wrote)."""
    out = tmp_path_factory.mktemp("numerics") / "rows.json"
    rows = hla_numerics.main([*TINY, "--json", str(out)])
    return rows, json.loads(out.read_text())


def test_every_configuration_once(run):
    rows, written = run
    expected = {(op, decay, norm) for op in OPS for decay in DECAYS for norm in (False, True)
                if not (op == "hla2_d2" and decay == "none")}
    got = [(r["op"], r["decay"], r["normalize"]) for r in rows]
    assert len(got) == len(expected) == 30 and set(got) == expected
    assert [(r["op"], r["decay"], r["normalize"]) for r in written] == got
    assert all(r["backend"] == "torch" and r["dtype"] == "bfloat16" and (r["T"], r["H"], r["D"]) == (T, H, D)
               for r in rows)
    text = hla_numerics.table(rows, grad=False)
    lines = text.splitlines()
    assert lines[0].startswith("| op | decay | normalize | backend | RMS o first |") and lines[1].startswith("|---")
    assert len(lines) == 2 + len(rows)
    assert sum(line.startswith("| hla2 (d2) | 0.9 |") for line in lines) == 2


def test_errors_finite_and_small(run):
    rows, _ = run
    for r in rows:
        assert r["finite"], r
        # bf16 rounding of q, k, v and o: a few 1e-3; the torch backend computes in fp32 on the rounded inputs
        for key in ("err_o", "err_o_worst_band", "err_o_same_inputs", "err_state"):
            assert 0 < r[key] < 2e-2, (key, r)
        assert r["err_o_same_inputs"] <= r["err_o"] * 1.5, r
        assert 0 <= r["err_fp32_vs_fp64"] < 1e-5, r
        assert r["grads"] is None


def test_fp32_against_fp32_is_exact():
    rows = hla_numerics.main([*TINY, "--dtype", "float32", "--ops", "hla2", "hla3", "--decays", "none", "0.9"])
    assert len(rows) == 8
    for r in rows:
        assert r["err_o"] == r["err_o_worst_band"] == r["err_o_same_inputs"] == r["err_state"] == 0.0, r
        assert r["err_fp32_vs_fp64"] < 1e-5


@pytest.mark.parametrize("label,alpha,normalize", [("hla2", None, False), ("hla2_d2", 0.9, False),
                                                   ("ahla", 0.99, True), ("hla3", None, False)])
def test_magnitudes_are_those_of_the_masked_definition(label, alpha, normalize):
    """RMS bands, growth and max |o| against hla_masked in float64 (an independent O(T^2) definition)."""
    op, conv = OPS[label]
    inputs = make_inputs(T, H, D, normalize, alpha, 0)
    row = measure(label, alpha, normalize, "torch", inputs, torch.device("cpu"), torch.bfloat16, 1024)
    q, k, v, g = (None if x is None else x.double() for x in inputs)
    if normalize:
        num = hla_masked(op, q, k, v, g, decay=conv)
        den = hla_masked(op, q, k, torch.ones_like(v[..., :1]), g, decay=conv)
        o = num / den
    else:
        o = hla_masked(op, q, k, v, g, decay=conv)
    spans = bands(T, 1024)
    assert spans == {"first": (0, 43), "mid": (44, 87), "last": (87, 130)}
    assert row["band"] == 43
    rms = {name: o[:, a:b].pow(2).mean().sqrt().item() for name, (a, b) in spans.items()}
    for name, value in rms.items():
        assert math.isclose(row[f"rms_{name}"], value, rel_tol=1e-5), name
    p = math.log(rms["last"] / rms["mid"]) / math.log((87 + 130 + 1) / (44 + 87 + 1))
    assert math.isclose(row["growth"], p, rel_tol=1e-4, abs_tol=1e-6)
    assert math.isclose(row["max_abs"], o.abs().max().item(), rel_tol=1e-5)
    if label == "hla2" and alpha is None:
        # undecayed: S = sum_i k_i k_i^T per head; o grows with t
        s = torch.einsum("bthi,bthj->bhij", k, k)
        assert math.isclose(row["state_rms"]["S"], s.pow(2).mean().sqrt().item(), rel_tol=1e-5)
        assert row["rms_first"] < row["rms_mid"] < row["rms_last"] and row["growth"] > 0.5


def test_decay_calibration():
    """g <= 0, fp32, mean(g) = log(alpha) exactly; q and k unit rows; elu + 1 features non-negative."""
    for alpha in (0.999, 0.9):
        q, k, _v, g = make_inputs(T, H, D, True, alpha, 0)
        assert g.dtype == torch.float32 and g.shape == (1, T, H) and bool((g <= 0).all())
        assert math.isclose(g.double().mean().item(), math.log(alpha), rel_tol=1e-5)
        assert bool((q >= 0).all() and (k >= 0).all())
        assert torch.allclose(q.norm(dim=-1), torch.ones(1, T, H), atol=1e-5)
    q, k, _v, g = make_inputs(T, H, D, False, None, 0)
    assert g is None and bool((q < 0).any())
    assert torch.allclose(k.norm(dim=-1), torch.ones(1, T, H), atol=1e-5)


def test_grad_columns():
    rows = hla_numerics.main([*TINY, "--grad", "--ops", "hla2", "--decays", "none", "0.99", "--normalize", "true",
                              "--no-reference"])
    assert [r["decay"] for r in rows] == ["none", "0.99"]
    assert set(rows[0]["grads"]) == {"q", "k", "v"} and set(rows[1]["grads"]) == {"q", "k", "v", "g"}
    for r in rows:
        assert r["err_fp32_vs_fp64"] is None
        assert all(0 < e < 3e-2 for e in r["grads"].values()), r["grads"]
    line = hla_numerics.table_row(rows[1])
    assert line.count("|") == hla_numerics.header(True)[0].count("|")
    assert hla_numerics.header(True)[0].endswith("| err dq | err dk | err dv | err dg |")


def test_backends_for():
    assert hla_numerics.backends_for("hla2", None, True) == ["fused"]
    assert hla_numerics.backends_for("hla3", None, True) == ["triton"]
    assert hla_numerics.backends_for("hla3", None, False) == ["torch"]
    assert hla_numerics.backends_for("hla3", ["fused", "triton"], True) == ["triton"]
    assert hla_numerics.backends_for("ahla", ["fused", "triton"], True) == ["fused", "triton"]
