"""benchmarks/peers.py's harness on CPU, with stand-in peers (the real ones need CUDA): a peer computing the same
function passes the cross-check, a wrong one shows a large error, one that raises is a "refused" row, an absent
package is listed as missing, and the timing table has hilo's ratio to the peer."""
from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

from benchmarks import peers

SMALL = peers.Shape("H2 K16 V16", 2, 16, 16)
GROUPED = peers.Shape("H3 K16 V8 shared", 3, 16, 8, grouped=True)


def refuse(x):
    raise RuntimeError("this peer refuses the machine\nsecond line")


def refuse_bare(x):
    raise ValueError  # as some peers do: the row names the type


def short_only(call):
    def peer(x):
        if x["q"].shape[1] > 45:
            raise NotImplementedError(f"T={x['q'].shape[1]}")
        return call(x)
    return peer


def test_cross_check_tells_right_wrong_and_refusing_peers_apart():
    same = peers.Peer("torch chunked", "linear_attn", None, peers.hilo_call("linear_attn", "torch"), (SMALL, GROUPED))
    wrong = peers.Peer("half output", "linear_attn", None, lambda x: 0.5 * same.call(x), (SMALL,))
    refusing = peers.Peer("refusing", "linear_attn", None, refuse, (SMALL,))
    absent = peers.Peer("absent", "linear_attn", "no_such_package_here", same.call)
    bare = peers.Peer("bare", "linear_attn", None, refuse_bare, (SMALL,))
    short = peers.Peer("short", "linear_attn", None, short_only(same.call), (SMALL,))
    reported = []
    checks, times, missing = peers.run(["linear_attn"], [32, 64], "cpu",
                                       peers=[same, wrong, refusing, absent, bare, short],
                                       check_t=45, tokens=64, backend=lambda op: "torch", report=reported.append)
    by = {(c["peer"], c["shape"]): c for c in checks}
    for shape in (SMALL, GROUPED):
        row = by[("torch chunked", shape.label)]
        assert {"o", "dq", "dk", "dv", "dg"} <= set(row)
        assert all(h < 1e-2 and p < 1e-2 for h, p in (row[q] for q in ("o", "dq", "dk", "dv", "dg")))
    assert by[("half output", SMALL.label)]["o"][1] > 0.4
    assert by[("refusing", SMALL.label)] == {"op": "linear_attn", "peer": "refusing", "shape": SMALL.label,
                                             "refused": "RuntimeError: this peer refuses the machine"}
    assert by[("bare", SMALL.label)]["refused"] == "ValueError"
    assert missing == ["absent (no_such_package_here)"]
    assert {(r["peer"], r["T"]) for r in times} == {(p, t) for p in ("torch chunked", "half output", "short")
                                                    for t in (32, 64)}
    assert [r["refused"] for r in times if "refused" in r] == ["NotImplementedError: T=64"]  # timed at T=32 still
    text = peers.tables(checks, times, missing)
    assert "| linear_attn | refusing | H2 K16 V16 | refused |" in text and "x |" in text
    assert "| linear_attn | short | H2 K16 V16 | 64 |" in text and "refused: NotImplementedError: T=64 |" in text
    assert "Missing peers (not installed): absent" in text
    # every row was reported as it was measured, as the tables' lines: a run killed midway keeps them
    assert sorted(reported) == sorted(line for line in text.splitlines() if line.startswith("| linear_attn |"))
    assert reported.index("| linear_attn | refusing | H2 K16 V16 | refused | RuntimeError: this peer refuses the "
                          "machine | - |") < reported.index(peers.time_line(times[-1]))


class _ForwardOnly(torch.autograd.Function):
    """The identity whose backward raises, as fla 0.6's gated backward does on Hopper with Triton < 3.7.1."""

    @staticmethod
    def forward(ctx, o):
        return o.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("this backward refuses the machine\nsecond line")


def test_a_refused_backward_keeps_the_forward_check_and_times():
    same = peers.hilo_call("linear_attn", "torch")
    fwd_only = peers.Peer("fwd only", "linear_attn", None, lambda x: _ForwardOnly.apply(same(x)), (SMALL,))
    half = peers.Peer("fwd only, half", "linear_attn", None, lambda x: _ForwardOnly.apply(0.5 * same(x)), (SMALL,))
    checks, times, _ = peers.run(["linear_attn"], [32], "cpu", peers=[fwd_only, half], check_t=45, tokens=64,
                                 backend=lambda op: "torch")
    by = {c["peer"]: c for c in checks}
    assert set(by["fwd only"]) == {"op", "peer", "shape", "o", "backward_refused"}
    assert by["fwd only"]["o"][1] < 1e-2 and by["fwd only, half"]["o"][1] > 0.4  # the forward is still checked
    assert by["fwd only"]["backward_refused"] == "RuntimeError: this backward refuses the machine"
    row = {r["peer"]: r for r in times}["fwd only"]
    assert row["peer_fwd"] > 0 and "peer_fwd_bwd" not in row and row["backward_refused"].startswith("RuntimeError")
    text = peers.tables(checks, times, [])
    assert "| linear_attn | fwd only | H2 K16 V16 | o | " in text
    assert "| linear_attn | fwd only | H2 K16 V16 | backward refused | RuntimeError: this backward refuses" in text
    line = peers.time_line(row)
    assert "backward refused: RuntimeError: this backward refuses the machine |" in line
    assert line.endswith(f"| {row['hilo_fwd'] / row['peer_fwd']:.2f}x | - |")


def test_inputs_match_what_each_peer_family_takes():
    x = peers.make_inputs("delta_rule", SMALL, 2, 40, "cpu")
    assert set(x) == {"q", "k", "v", "g", "beta"} and bool((x["g"] < 0).all())
    assert x["k"].norm(dim=-1).sub(1).abs().max() < 1e-5  # the delta rule's keys are L2-normalised
    x = peers.make_inputs("loglinear_attn", GROUPED, 1, 40, "cpu")
    assert x["q"].shape == (1, 40, 1, 16) and x["v"].shape == (1, 40, 3, 8) and x["level_scales"].shape[-1] >= 6
    x = peers.make_inputs("loglinear_delta_rule", SMALL, 2, 40, "cpu")
    assert set(x) == {"q", "k", "v", "g", "beta", "level_scales"} and x["level_scales"].shape == (2, 40, 2, 7)


# A stand-in for the log-linear paper's package `hattention` (github.com/HanGuo97/log-linear-attention), with the
# real one's calling contract: hattention_kernel(q, k, v, b, g, l, scale, head_first, level_base, htype, hstruct,
# chunk_sizes, chunkwise, use_qk_l2norm_in_kernel) on [B, T, H, D] tensors, T a multiple of the chunk, at least
# the levels of T, no scale in the Mamba-2 form, L2-normalised q and k times scale in the Gated DeltaNet form.
# Its __init__ fails (the real one imports CUDA extensions), its make_levels_matrix raises (the real one reads
# files from its authors' machines), and it computes the paper's definitions: the Mamba-2 form from the level
# table, the Gated DeltaNet form by the paper's recurrence (each level full at 2^l tokens carries into the next).
FAKE_BASE = '''
from enum import Enum


class HType(Enum):
    WEAK = 0
    STRONG = 1


class HStruct(Enum):
    MAMBA2 = 0
    GDELTA = 1
'''

FAKE_TABLE = '''
def make_levels_matrix(*args, **kwargs):
    raise FileNotFoundError("/export/share/llut.length-16384.base-2.pth")
'''

FAKE_KERNEL = '''
import torch

from hattention import chunkwise as chunkwise_module  # the kernel has an argument of that name
from hattention.base import HStruct, HType


def _l2norm(x):
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def hattention_kernel(q, k, v, b, g, l, scale, head_first, level_base, htype, hstruct, chunk_sizes=None,
                      chunkwise=True, use_qk_l2norm_in_kernel=False):
    bsz, t, grp, dk = k.shape
    h, dv, nl, dtype = v.shape[2], v.shape[3], l.shape[3], q.dtype
    chunk = (chunk_sizes or (64, 64))[0]
    assert not head_first and level_base == 2 and htype is HType.WEAK and chunkwise and h % grp == 0
    assert q.shape == k.shape and v.shape[:2] == (bsz, t) and g.shape == l.shape[:3] == (bsz, t, h)
    assert g.dtype == torch.float32 and bool((g <= 0).all()), "g: natural-log decays"
    if t % chunk:
        raise ValueError
    if nl < chunk.bit_length() + (t // chunk - 1).bit_length():
        raise ValueError
    q, k = (x.float().repeat_interleave(h // grp, dim=2) for x in (q, k))
    v, lam = v.float(), l.float()
    if hstruct is HStruct.MAMBA2:
        assert b is None and scale is None and not use_qk_l2norm_in_kernel
        table = chunkwise_module.make_levels_matrix(length=t, base=2, htype=htype, dtype=torch.int64,
                                                    device=l.device, clamp_min=0)
        weight = lam.gather(3, table[None, :, None, :].expand(bsz, t, h, t))  # [B, T target, H, S source]
        cum = g.cumsum(1)
        decay = cum[..., None] - cum.permute(0, 2, 1)[:, None]
        causal = torch.ones(t, t, dtype=torch.bool).tril()[None, :, None, :]
        scores = torch.einsum("bthk,bshk->bths", q, k) * weight * torch.where(causal, decay, -torch.inf).exp()
        return torch.einsum("bths,bshv->bthv", scores, v).to(dtype)
    assert hstruct is HStruct.GDELTA and b is not None and b.shape == (bsz, t, h)
    assert use_qk_l2norm_in_kernel and isinstance(scale, float)
    q, k, b = _l2norm(q) * scale, _l2norm(k), b.float()
    states, counts, out = [torch.zeros(bsz, h, dk, dv) for _ in range(nl)], [0] * nl, []
    for i in range(t):
        for lev in range(nl - 1):
            if counts[lev] < 2 ** lev:
                break
            states[lev + 1], counts[lev + 1] = states[lev + 1] + states[lev], counts[lev + 1] + counts[lev]
            states[lev], counts[lev] = torch.zeros_like(states[lev]), 0
        kk, bb = k[:, i, :, :, None], b[:, i, :, None, None]
        gate = g[:, i, :, None, None].exp() * (torch.eye(dk) - bb * kk * kk.transpose(-1, -2))
        states = [gate @ s for s in states]
        states[0], counts[0] = bb * kk * v[:, i, :, None, :], counts[0] + 1
        read = sum(lam[:, i, :, lev, None, None] * states[lev] for lev in range(nl))
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, i], read))
    return torch.stack(out, 1).to(dtype)
'''


def fake_package(tmp_path, monkeypatch, name: str, files: dict[str, str]):
    """A stand-in package for a fixture: files (path under tmp_path -> text) written, tmp_path first on sys.path
    while the test runs, then package name's modules forgotten."""
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield
    for module in [n for n in sys.modules if n == name or n.startswith(f"{name}.")]:
        del sys.modules[module]


@pytest.fixture
def fake_hattention(tmp_path, monkeypatch):
    yield from fake_package(tmp_path, monkeypatch, "hattention", {
        "hattention/__init__.py": 'raise ImportError("the package __init__ ran (it imports causal_conv1d)")\n',
        "hattention/base.py": FAKE_BASE, "hattention/chunkwise.py": FAKE_TABLE,
        "hattention/chunkwise_hgdn.py": FAKE_TABLE, "hattention/kernel.py": FAKE_KERNEL})


@pytest.mark.parametrize("t", [20, 70])  # padded to 64 tokens (and from 6 to 7 levels), to 128
def test_hattention_peers_compute_hilos_functions(fake_hattention, t):
    hatt = [p for p in peers.PEERS if p.package == "hattention"]
    assert {p.op for p in hatt} == {"loglinear_attn", "loglinear_delta_rule"}
    checks, times, missing = peers.run(["loglinear_attn", "loglinear_delta_rule"], [64], "cpu",
                                       peers=[peers.Peer(p.name, p.op, p.package, p.call, (SMALL,)) for p in hatt],
                                       check_t=t, tokens=64, backend=lambda op: "torch")
    assert missing == [] and len(checks) == 2 and len(times) == 2
    for row in checks:
        quantities = {"o", "dq", "dk", "dv", "dg", "dlevel_scales"} | ({"dbeta"} if "Delta" in row["peer"] else set())
        assert quantities <= set(row), row
        assert all(h < 1e-2 and p < 1e-2 for h, p in (row[q] for q in quantities)), row


def test_hattention_level_table_is_the_fenwick_level():
    weak = types.SimpleNamespace(name="WEAK")
    table = peers._levels_table(length=300, base=2, htype=weak, dtype=torch.int64, device="cpu", clamp_min=0)
    expect = torch.tensor([[(t ^ s).bit_length() if s <= t else 0 for s in range(300)] for t in range(300)])
    assert torch.equal(table, expect)
    raw = peers._levels_table(length=5, base=2, htype=weak, dtype=torch.int64, device="cpu")
    assert raw[0, 1] == -1 and raw[4, 3] == 3
    with pytest.raises(NotImplementedError, match="HType.WEAK only"):
        peers._levels_table(length=5, base=2, htype=types.SimpleNamespace(name="STRONG"), dtype=torch.int64,
                            device="cpu")


# A stand-in for fla's chunk_simple_gla (the peer of hla2, twice): its contract, (o, final state) from
# q, k [B, T, H, K], v [B, T, H, V], g [B, T, H] per-token log decays and scale, computed from the definition
# o_t = scale * sum_{s <= t} exp(G_t - G_s) (q_t . k_s) v_s, G the running sum of g.
FAKE_SIMPLE_GLA = '''
import torch


def chunk_simple_gla(q, k, v, g, scale):
    cum = g.float().cumsum(1)
    decay = (cum[:, :, None] - cum[:, None]).permute(0, 3, 1, 2)  # [B, H, T target, S source]
    causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril()
    scores = torch.einsum("bthk,bshk->bhts", q.float(), k.float()) * torch.where(causal, decay, -torch.inf).exp()
    return (scale * torch.einsum("bhts,bshv->bthv", scores, v.float())).to(q.dtype), None
'''


@pytest.fixture
def fake_fla(tmp_path, monkeypatch):
    yield from fake_package(tmp_path, monkeypatch, "fla", {
        "fla/__init__.py": "", "fla/ops/__init__.py": "", "fla/ops/simple_gla/__init__.py": FAKE_SIMPLE_GLA})


def test_hla2_peer_is_hla2_as_two_simple_gla_passes(fake_fla):
    (peer,) = [p for p in peers.PEERS if p.op == "hla2"]
    x = peers.make_inputs("hla2", SMALL, 2, 40, "cpu")
    assert all(x[n].norm(dim=-1).sub(1).abs().max() < 1e-5 for n in ("q", "k"))  # as the HLA layers feed it
    checks, times, missing = peers.run(["hla2"], [32], "cpu", peers=[peers.Peer(peer.name, "hla2", "fla", peer.call,
                                                                               (SMALL,))],
                                       check_t=45, tokens=64, backend=lambda op: "torch")
    assert missing == [] and len(times) == 1
    (row,) = checks
    assert {"o", "dq", "dk", "dv", "dg"} <= set(row), row
    assert all(h < 1e-2 and p < 1e-2 for h, p in (row[q] for q in ("o", "dq", "dk", "dv", "dg"))), row
