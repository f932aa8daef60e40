"""Session 10 (GPU): loglinear_delta_rule's per-chunk glue eager, compiled (inductor, dynamic) and compiled with TF32
products for 16-bit inputs (HILO_LOGLINEAR_DELTA glue=..., glue_tf32=...): kernels.py's bf16 check against the fp32
oracle, then fwd and fwd+bwd ms at 16K x 2, H = 16, K = V = 128 (do_bench medians), one process.

    python benchmarks/gpu_sessions/s10_glue.py
"""
import sys
import time
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.kernels import CASES, _op_fn, check
from kernels.loglinear_delta_rule import triton_bwd

VARIANTS = [("eager", "0"), ("compiled", "0"), ("compiled", "1")]


def main():
    case = CASES["loglinear_delta_rule"]
    print("| glue | tf32 | check (worst ratio / tol) | fwd ms | fwd+bwd ms | first call s |")
    print("|---|---|---|---|---|---|")
    for glue, tf32 in VARIANTS:
        triton_bwd.OPTIONS.update(glue=glue, glue_tf32=tf32)
        t0 = time.time()
        rows = check("loglinear_delta_rule", case, "cuda")
        first = time.time() - t0
        bad = [f"{shape} {q} {r:.2e}>{tol}" for shape, q, r, tol in rows if not r <= tol]
        worst = max(rows, key=lambda r: r[2] / r[3])
        verdict = ("ok" if not bad else "FAIL " + "; ".join(bad)) + f" ({worst[1]} {worst[2]:.2e} / {worst[3]})"
        fwd, fwd_bwd, leaves = _op_fn(case, 2, 16384, 16, 128, "cuda")
        f = triton.testing.do_bench(fwd, warmup=10, rep=60, return_mode="median")
        fb = triton.testing.do_bench(fwd_bwd, warmup=10, rep=60, grad_to_none=leaves, return_mode="median")
        print(f"| {glue} | {tf32} | {verdict} | {f:.3f} | {fb:.3f} | {first:.0f} |", flush=True)
        del fwd, fwd_bwd, leaves
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
