"""benchmarks/peers.py's harness on CPU, with stand-in peers (the real ones need CUDA): a peer computing the same
function passes the cross-check, a wrong one shows a large error, one that raises is a "refused" row, an absent
package is listed as missing, and the timing table has hilo's ratio to the peer."""
from __future__ import annotations

from benchmarks import peers

SMALL = peers.Shape("H2 K16 V16", 2, 16, 16)
GROUPED = peers.Shape("H3 K16 V8 shared", 3, 16, 8, grouped=True)


def refuse(x):
    raise RuntimeError("this peer refuses the machine\nsecond line")


def test_cross_check_tells_right_wrong_and_refusing_peers_apart():
    same = peers.Peer("torch chunked", "linear_attn", None, peers.hilo_call("linear_attn", "torch"), (SMALL, GROUPED))
    wrong = peers.Peer("half output", "linear_attn", None, lambda x: 0.5 * same.call(x), (SMALL,))
    refusing = peers.Peer("refusing", "linear_attn", None, refuse, (SMALL,))
    absent = peers.Peer("absent", "linear_attn", "no_such_package_here", same.call)
    checks, times, missing = peers.run(["linear_attn"], [32], "cpu", peers=[same, wrong, refusing, absent],
                                       check_t=45, tokens=64, backend=lambda op: "torch")
    by = {(c["peer"], c["shape"]): c for c in checks}
    for shape in (SMALL, GROUPED):
        row = by[("torch chunked", shape.label)]
        assert {"o", "dq", "dk", "dv", "dg"} <= set(row)
        assert all(h < 1e-2 and p < 1e-2 for h, p in (row[q] for q in ("o", "dq", "dk", "dv", "dg")))
    assert by[("half output", SMALL.label)]["o"][1] > 0.4
    assert by[("refusing", SMALL.label)] == {"op": "linear_attn", "peer": "refusing", "shape": SMALL.label,
                                             "refused": "this peer refuses the machine"}
    assert missing == ["absent (no_such_package_here)"]
    assert {(r["peer"], r["T"]) for r in times} == {("torch chunked", 32), ("half output", 32)}
    text = peers.tables(checks, times, missing)
    assert "| linear_attn | refusing | H2 K16 V16 | refused |" in text and "x |" in text
    assert "Missing peers (not installed): absent" in text


def test_inputs_match_what_each_peer_family_takes():
    x = peers.make_inputs("delta_rule", SMALL, 2, 40, "cpu")
    assert set(x) == {"q", "k", "v", "g", "beta"} and bool((x["g"] < 0).all())
    assert x["k"].norm(dim=-1).sub(1).abs().max() < 1e-5  # the delta rule's keys are L2-normalised
    x = peers.make_inputs("loglinear_attn", GROUPED, 1, 40, "cpu")
    assert x["q"].shape == (1, 40, 1, 16) and x["v"].shape == (1, 40, 3, 8) and x["level_scales"].shape[-1] >= 6
