"""On a GPU, each installed peer of benchmarks/peers.py (fla, mamba_ssm, the log-linear paper's hattention kernels)
as an independent oracle of hilo's operator: on bf16 inputs of an odd length, hilo's GPU backend and the peer both
agree with hilo's fp32 oracle, the output and the gradient of every input the two share. hilo is held to the bf16
bounds of docs/kernels.md; the peer to PEER_TOL, loose enough for another kernel's bf16 rounding and far below the
O(1) error ratio of a different function (a missed scale, a gate of the wrong sign, another level indexing). A peer
whose package is missing skips; one that refuses this machine (a version check, a kernel that does not compile on
this Triton) skips with its message, since it says nothing about hilo; one whose backward alone refuses has its
output checked, then skips naming the refusal."""
import pytest
import torch

from benchmarks import peers
from hilo_kernels.common.checks import CASES, OUT_TOL

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="the peers need CUDA")]

PEER_TOL = 5e-2


def _peer_shapes():
    return [pytest.param(p, s, id=f"{p.op}-{p.name}-{s.label}") for p in peers.PEERS for s in p.shapes]


@pytest.mark.parametrize(("peer", "shape"), _peer_shapes())
def test_peer_and_hilo_compute_one_function(peer, shape):
    if not peers.installed(peer.package):
        pytest.skip(f"{peer.name}: {peer.package} is not installed")
    row = peers.cross_check(peer.op, peer, shape, "cuda", peers.hilo_backend(peer.op))
    if "refused" in row:
        pytest.skip(f"{peer.name} refuses this machine: {row['refused']}")
    refused_backward = row.pop("backward_refused", None)
    assert "o" in row and (len(row) > 1 or refused_backward), row  # the output and a gradient were compared
    grad_tol = CASES[peer.op].grad_tol if peer.op in CASES else {}
    failures = []
    for quantity, (hilo_err, peer_err) in row.items():
        hilo_tol = OUT_TOL if quantity == "o" else grad_tol.get(quantity[1:], 1e-2)
        if not hilo_err <= hilo_tol:
            failures.append(f"hilo {quantity}: {hilo_err:.2e} > {hilo_tol:.0e}")
        if not peer_err <= PEER_TOL:
            failures.append(f"{peer.name} {quantity}: {peer_err:.2e} > {PEER_TOL:.0e}")
    assert not failures, "\n".join(failures)
    if refused_backward:
        pytest.skip(f"{peer.name}: the forward agrees; its backward refuses this machine: {refused_backward}")
