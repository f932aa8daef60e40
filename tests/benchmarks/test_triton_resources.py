"""benchmarks/triton_resources.py compiles linear_attn's real launches for sm_90 on a CPU machine: the Triton
interpreter that runs the kernels here does not type-check them (session 16: an unsegmented launch's dummy bf16
pointer reached tl.exp, which compiles only fp32 / fp64; every GPU call of the default path failed)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("options", ["state_segments=1", "state_segments=3"])
def test_linear_attn_launches_compile_for_sm90(options):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["HILO_LINEAR_ATTN"] = options
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "triton_resources.py"), "--family",
                        "linear_attn", "--dims", "128x128,64x64", "--dtypes", "bf16,fp32", "--heads", "16"],
                       check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "0 error(s)" in out, out[-3000:]
    # every state pass compiled, and segmented launches (FINALS) only when segments are asked for
    assert out.count("_chunk_states_fwd") >= 2 and out.count("_chunk_dstates_bwd") >= 2, out[-3000:]
    assert ("FINALS" in out) == (options != "state_segments=1"), out[-3000:]
