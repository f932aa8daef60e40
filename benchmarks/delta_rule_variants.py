"""A/B of kernels.delta_rule's Triton build switches (kernels/delta_rule/triton_fwd.py OPTIONS) in one GPU process:
for each variant, bf16 correctness against the fp32 naive oracle (SPEC §2 error ratios for o, final state and every
gradient, at B2 T777 H4 D128 and a varlen batch), forward and forward+backward medians of do_bench at T=1024 B=32
and T=32768 B=1 (H16 D128, bf16), and per-kernel times from torch.profiler.

    python benchmarks/delta_rule_variants.py                      # every variant (about 1-2 minutes on an H200)
    python benchmarks/delta_rule_variants.py --variants old new   # a subset
    python benchmarks/delta_rule_variants.py --no-profile

Variants: "old" is the build before the switches existed (fp32/tf32 backward intermediates, two backward kernels,
state V-blocks down to 32, tf32 prepare products, separate intra and output kernels); "new" is the default OPTIONS;
lowp_bwd, fused, bv16 and prep_split turn the switches on one at a time from "old" (new = prep_split +
state_scale_v); the rest change one thing of the new build (launch warps/stages/blocks, or one OPTIONS switch). Variants that would
start after BUDGET_S seconds are skipped (name them with --variants to run them).
Imports only torch, triton, kernels and benchmarks.kernels.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernels import CASES, GATE_TOL, OUT_TOL, QKV_TOL, _leaves, _make_delta_rule, _run_with_grads
from kernels import delta_rule
from kernels.common import error_ratio
from kernels.delta_rule import triton_fwd

DEFAULTS = dict(triton_fwd.OPTIONS)
WARPS, STAGES, SBV = dict(triton_fwd.NUM_WARPS), dict(triton_fwd.NUM_STAGES), dict(triton_fwd.STATE_BV)
GB = dict(triton_fwd.GRADS_BLOCKS)
OLD = {"lowp_bwd": False, "prepare_mode": 0, "fused_bwd": False, "state_bv_min": 32, "intra_in_state_bwd": 0,
       "output_in_state": 0, "state_scale_v": False}
# name -> OPTIONS, plus optional "_warps" / "_stages" / "_state_bv" / "_grads_blocks" overrides of triton_fwd.NUM_WARPS
# / NUM_STAGES / STATE_BV / GRADS_BLOCKS (launch tuning).
VARIANTS = {
    "old": OLD,
    "new": DEFAULTS,  # every switch at its default
    "new_bv32": {**DEFAULTS, "state_bv_min": 32},  # new with the old state V-block floor (also a fallback)
    "lowp_bwd": {**OLD, "lowp_bwd": True},
    "fused": {**OLD, "lowp_bwd": True, "fused_bwd": True},
    "bv16": {**OLD, "lowp_bwd": True, "fused_bwd": True, "state_bv_min": 16},
    "prep_split": {**OLD, "lowp_bwd": True, "fused_bwd": True, "state_bv_min": 16, "prepare_mode": 2},
    # new = prep_split + state_scale_v
    # one change to the new build
    "new_state_fw8": {**DEFAULTS, "_warps": {"state": 8}},  # forward state pass: 8 warps spill far less on sm_90
    "new_prep_w8": {**DEFAULTS, "_warps": {"prepare": 8}},  # prepare: no spill at 8 warps on sm_90
    "new_grads_kb64": {**DEFAULTS, "_grads_blocks": {"kb": 64, "bv": 64, "bv2": 32}},
    "prep_bf16": {**DEFAULTS, "prepare_mode": 1},
    "intra_auto": {**DEFAULTS, "intra_in_state_bwd": 2},
    "intra_always": {**DEFAULTS, "intra_in_state_bwd": 1},
    "out_auto": {**DEFAULTS, "output_in_state": 2},
    "out_always": {**DEFAULTS, "output_in_state": 1},
    "fused_tf32": {**OLD, "fused_bwd": True},  # the fused kernel alone, with fp32 (tf32) operands
    "new_grads_s3": {**DEFAULTS, "_stages": {"grads": 3}},
    "new_grads_w4": {**DEFAULTS, "_warps": {"grads": 4}},
}
BUDGET_S = 140  # variants that would start after this many seconds are skipped (the run must stay under 3 min)


def apply_variant(spec: dict):
    triton_fwd.OPTIONS.clear()
    triton_fwd.OPTIONS.update({k: v for k, v in spec.items() if not k.startswith("_")})
    for table, base, key in ((triton_fwd.NUM_WARPS, WARPS, "_warps"), (triton_fwd.NUM_STAGES, STAGES, "_stages"),
                             (triton_fwd.STATE_BV, SBV, "_state_bv"), (triton_fwd.GRADS_BLOCKS, GB, "_grads_blocks")):
        table.clear()
        table.update(base)
        table.update(spec.get(key, {}))
QUANTITIES = ["o", "final_state", "dq", "dk", "dv", "dbeta", "dg", "dinitial_state"]
TOLS = [OUT_TOL, OUT_TOL, QKV_TOL, QKV_TOL, QKV_TOL, GATE_TOL, GATE_TOL, QKV_TOL]
SHAPES = [("B2 T777", 2, 777, None), ("varlen 1,15,700,333", 1, 1049, [0, 1, 16, 716, 1049])]
TIMED = [(1024, 32), (32768, 1)]
SHORT = {"_prepare_kernel": "prep", "_state_kernel": "state", "_output_kernel": "out", "_intra_kernel": "intra",
         "_state_bwd_kernel": "st_bwd", "_grads_qk_kernel": "g_qk", "_grads_wy_kernel": "g_wy",
         "_grads_kernel": "grads"}


def _flatten(o, s, grads):
    return [o, s] + [grads[n] for n in ("q", "k", "v", "beta", "g", "initial_state")]


def references(device):
    """fp32 naive-oracle outputs and gradients for each correctness shape (computed once for every variant)."""
    case = CASES["delta_rule"]
    out = []
    for label, b, t, bounds in SHAPES:
        n = b if bounds is None else len(bounds) - 1
        cu = None if bounds is None else torch.tensor(bounds, device=device, dtype=torch.int32)
        inputs = case.make(b, t, 4, 128, device, seed=0, n_state=n)
        ref = _flatten(*_run_with_grads(case, inputs, cu, "naive", torch.float32))
        out.append((label, inputs, cu, ref))
    return out


def check(refs):
    """Per shape, the error ratios of bf16 triton vs the fp32 oracle, in QUANTITIES order."""
    case = CASES["delta_rule"]
    rows = []
    for label, inputs, cu, ref in refs:
        got = _flatten(*_run_with_grads(case, inputs, cu, "triton", torch.bfloat16))
        rows.append((label, [error_ratio(a, r) for a, r in zip(got, ref)]))
    return rows


def _fns(b, t, device):
    x = _leaves(_make_delta_rule(b, t, 16, 128, device, seed=0), torch.bfloat16)

    def fwd():
        return delta_rule(x["q"], x["k"], x["v"], x["beta"], x["g"])

    do = torch.randn_like(fwd()[0].detach())

    def fwd_bwd():
        o, _ = fwd()
        o.backward(do)

    return fwd, fwd_bwd, list(x.values())


def timings(device, profile: bool):
    import triton.testing
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    res = {}
    for t, b in TIMED:
        fwd, fwd_bwd, leaves = _fns(b, t, device)
        f = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
        fb = triton.testing.do_bench(fwd_bwd, warmup=25, rep=100, grad_to_none=leaves, return_mode="median")
        per = {}
        if profile:
            calls = 3
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    for leaf in leaves:
                        leaf.grad = None
                    fwd_bwd()
                torch.cuda.synchronize()
            for e in prof.key_averages():
                if e.key in SHORT:
                    per[SHORT[e.key]] = (getattr(e, "device_time_total", None) or e.cuda_time_total) / calls
        res[(t, b)] = (f, fb, per)
        del fwd, fwd_bwd, leaves
        torch.cuda.empty_cache()
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--no-check", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/delta_rule_variants.py needs a CUDA GPU")
    device = "cuda"
    t0 = time.time()
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; default OPTIONS {DEFAULTS}", flush=True)
    refs = None if args.no_check else references(device)
    print(f"fp32 oracle ready ({time.time() - t0:.0f} s)", flush=True)
    results = {}
    for name in args.variants:
        if time.time() - t0 > BUDGET_S:
            print(f"[{name}] skipped: past the {BUDGET_S} s budget", flush=True)
            continue
        apply_variant(VARIANTS[name])
        t1 = time.time()
        try:
            chk = None if refs is None else check(refs)
            tim = timings(device, not args.no_profile)
        except Exception as e:  # noqa: BLE001 (a variant failing to compile, e.g. shared memory: reported, not fatal)
            print(f"[{name}] FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            torch.cuda.empty_cache()
            continue
        results[name] = (chk, tim)
        line = f"[{name}] {VARIANTS[name]} ({time.time() - t1:.0f} s)"
        if chk is not None:
            worst = [max(r[i] for _, r in chk) for i in range(len(QUANTITIES))]
            bad = [q for q, w, tol in zip(QUANTITIES, worst, TOLS) if w > tol]
            line += "  correctness " + ("ok" if not bad else "FAILS " + ",".join(bad))
        print(line, flush=True)
    apply_variant(DEFAULTS)

    if refs is not None:
        print("\nbf16 triton vs fp32 naive, error ratios (tolerances: o/S 5e-3, dq/dk/dv/dh0 1e-2, dbeta/dg 2e-2)")
        print(f"| variant | case | {' | '.join(QUANTITIES)} |")
        print("|---|---|" + "---|" * len(QUANTITIES))
        for name, (chk, _) in results.items():
            for label, r in chk:
                cells = [f"{x:.2e}" + ("" if x <= tol else " NO") for x, tol in zip(r, TOLS)]
                print(f"| {name} | {label} | {' | '.join(cells)} |")
    print("\nms, medians of do_bench, bf16, H16 D128")
    head = " | ".join(f"T{t} B{b} fwd | T{t} B{b} fwd+bwd" for t, b in TIMED)
    print(f"| variant | {head} |")
    print("|---|" + "---|" * (2 * len(TIMED)))
    for name, (_, tim) in results.items():
        print(f"| {name} | " + " | ".join(f"{tim[s][0]:.3f} | {tim[s][1]:.3f}" for s in TIMED) + " |")
    if not args.no_profile:
        for t, b in TIMED:
            print(f"\nus per fwd+bwd call per kernel (torch.profiler), T={t} B={b}")
            cols = list(SHORT.values())
            print("| variant | " + " | ".join(cols) + " | sum |")
            print("|---|" + "---|" * (len(cols) + 1))
            for name, (_, tim) in results.items():
                per = tim[(t, b)][2]
                print(f"| {name} | " + " | ".join(f"{per[c]:.0f}" if c in per else "-" for c in cols)
                      + f" | {sum(per.values()):.0f} |")
    print(f"\ntotal {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
