"""benchmarks/triton_resources.py compiles kernels' real launches for sm_90 on a CPU machine: the Triton interpreter
that runs the kernels here does not type-check them (session 16: an unsegmented launch's dummy bf16 pointer reached
tl.exp, which compiles only fp32 / fp64; every GPU call of linear_attn's default path failed)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _audit(family: str, dims: str, dtypes: str, options: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["HILO_LINEAR_ATTN"] = options
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "triton_resources.py"), "--family", family,
                        "--dims", dims, "--dtypes", dtypes, "--heads", "16"],
                       check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "0 error(s)" in out, out[-3000:]
    return out


@pytest.mark.parametrize("options", ["state_segments=1", "state_segments=3"])
def test_linear_attn_launches_compile_for_sm90(options):
    out = _audit("linear_attn", "128x128,64x64", "bf16,fp32", options)
    # every state pass compiled, and segmented launches (FINALS) only when segments are asked for
    assert out.count("_chunk_states_fwd") >= 2 and out.count("_chunk_dstates_bwd") >= 2, out[-3000:]
    assert ("FINALS" in out) == (options != "state_segments=1"), out[-3000:]


def test_hla_one_op_launches_compile_for_sm90():
    """hla2's and hla3's one ops' accumulating backward compiles: ACC_DQ with SELF_V (a barrier between a store and
    a load) and ACC_DQ alone (hla3's middle pass)."""
    out = _audit("hla_one_op", "64x64", "bf16", "")
    assert "ACC_DQ SELF_V" in out, out[-3000:]
    assert any(line.rstrip().endswith("ACC_DQ w4s1") for line in out.splitlines()), out[-3000:]
