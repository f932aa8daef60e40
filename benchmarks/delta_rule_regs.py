"""Registers, spill stack and shared memory of kernels.delta_rule's Triton kernels compiled for sm_90 (H100/H200),
bf16, H=16, K=V=128, at the launch settings of triton_fwd (OPTIONS, NUM_WARPS, NUM_STAGES, GRADS_BLOCKS). Needs no
GPU: Triton's CUDA backend compiles for the target and its bundled cuobjdump reads the cubin.

    python benchmarks/delta_rule_regs.py            # the kernels the default build launches
    python benchmarks/delta_rule_regs.py --all      # also the alternatives behind the OPTIONS switches

STACK > 0 means spills to local memory (per thread, bytes). Counts come from the local Triton, which may not be the
GPU machine's version.
"""
from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # must be unset before the kernels are decorated

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.delta_rule import triton_bwd as B
from kernels.delta_rule import triton_fwd as F

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
# Pointer dtypes that are not the input dtype (bf16); other scalars are fp32.
TYPES = {"gamma_ptr": "*fp32", "tinv_ptr": "*fp32", "g_ptr": "*fp32", "table_ptr": "*i32", "bounds_ptr": "*i64",
         "choff_ptr": "*i32", "h0_ptr": "*fp32", "ht_ptr": "*fp32", "dht_ptr": "*fp32", "dh0_ptr": "*fp32",
         "dgam_ptr": "*fp32", "dbeta_ptr": "*fp32", "dg_ptr": "*fp32"}


def compile_stats(kernel, consts: dict, num_warps: int, num_stages: int, types: dict | None = None) -> str:
    names = list(inspect.signature(kernel.fn).parameters)
    types = {**TYPES, **(types or {})}
    sig = {n: "constexpr" if n in consts else types.get(n, "*bf16" if n.endswith("_ptr") else "fp32") for n in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    try:
        k = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    except Exception as e:  # noqa: BLE001 (report, keep going)
        return f"COMPILE ERROR {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    out = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True, text=True,
                         check=False)
    os.unlink(f.name)
    res = dict(re.findall(r"(REG|STACK):(\d+)", out.stdout))
    return f"regs {res.get('REG', '?'):>3}  spill stack {res.get('STACK', '?'):>5} B  smem {k.metadata.shared:6d} B"


def configs(everything: bool):
    w, s, gb, o = F.NUM_WARPS, F.NUM_STAGES, F.GRADS_BLOCKS, F.OPTIONS
    base = {"H": 16, "K": 128, "V": 128, "C": 64}
    mid = {"du_ptr": "*bf16" if o["lowp_bwd"] else "*fp32"}
    for mode in ((0, 1, 2) if everything else (o["prepare_mode"],)):
        yield (f"prepare (prepare_mode {mode})", F._prepare_kernel,
               {**base, "KB": 64, "BV": 64, "HAS_G": True, "PREC": "tf32", "MODE": mode}, w["prepare"], 3, None)
    for bv in (64, 16):
        for out in ((False, True) if everything else (bool(o["output_in_state"] == 1),)):
            yield (f"state BV={bv}{' +O' if out else ''}", F._state_kernel,
                   {**base, "BK": 128, "BV": bv, "HAS_H0": False, "STORE_HT": False, "PREC": "tf32", "OUT": out,
                    "SCALE_V": bool(o["state_scale_v"])},
                   w["state"], F.state_stages(128), None)
    yield ("output", F._output_kernel, {**base, "BK": 128, "BV": 64, "PREC": "tf32"}, w["output"], 3, None)
    yield ("intra", B._intra_kernel, {**base, "BK": 128, "BV": 64, "PREC": "tf32"}, w["intra"], 3, mid)
    for bv in (64, 16):
        for intra in ((False, True) if everything else (bool(o["intra_in_state_bwd"] == 1),)):
            yield (f"state_bwd BV={bv}{' +intra' if intra else ''}", B._state_bwd_kernel,
                   {**base, "BK": 128, "BV": bv, "HAS_DHT": False, "STORE_DH0": False, "PREC": "tf32", "INTRA": intra,
                    "SCALE_V": 2 if o["state_scale_v"] else 0},
                   w["state_bwd"], F.state_stages(128), mid)
    if o["fused_bwd"] or everything:
        yield (f"grads (kb {gb['kb']}, bv {gb['bv']}, bv2 {gb['bv2']})", B._grads_kernel,
               {**base, "KB": gb["kb"], "BV": gb["bv"], "BV2": gb["bv2"], "HAS_G": True, "PREC": "tf32",
                "LOWP": bool(o["lowp_bwd"])}, w["grads"], s["grads"], mid)
    if not o["fused_bwd"] or everything:
        m2 = {**mid, "dw_ptr": mid["du_ptr"], "dk_ptr": mid["du_ptr"], "dk_part_ptr": mid["du_ptr"]}
        yield ("grads_qk", B._grads_qk_kernel, {**base, "KB": 64, "BV": 32, "PREC": "tf32"}, w["grads_qk"],
               s["grads_qk"], m2)
        yield ("grads_wy", B._grads_wy_kernel, {**base, "KB": 64, "BV": 64, "HAS_G": True, "PREC": "tf32",
                                                "LOWP": bool(o["lowp_bwd"])}, w["grads_wy"], s["grads_wy"],
               {**m2, "dk_ptr": "*bf16"})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--all", action="store_true", help="also the kernels behind the non-default switches")
    args = p.parse_args(argv)
    print(f"triton {triton.__version__}, sm_90, bf16, H16 K=V=128; OPTIONS {F.OPTIONS}")
    for label, kernel, consts, warps, stages, types in configs(args.all):
        print(f"  {label:34s} w{warps} s{stages}  {compile_stats(kernel, consts, warps, stages, types)}", flush=True)


if __name__ == "__main__":
    main()
