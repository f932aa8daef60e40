"""Kernel benchmark: bf16 correctness on the GPU against the fp32 oracle, then forward and forward+backward
times beside SDPA (flash and cuDNN backends) at the reference shapes (B*T = 32,768 tokens, 16 heads, head dim 128;
docs/performance.md has the current numbers).

    python benchmarks/operators.py                         # every op in CASES
    python benchmarks/operators.py --ops linear_attn --seqlens 1024 4096 32768
    python benchmarks/operators.py --ops delta_rule --seqlens 8192 \
        --settings delta_rule.grads_warps=4,8 delta_rule.grads_stages=2,3   # every combination, a row each

Each op is one entry of CASES (an OpCase, hilo_kernels/common/checks.py): how to make its inputs, how to call it, and
which gradients it has with their tolerances. Correctness compares the op's GPU backend (OpCase.backend, "triton" unless
named) on bf16 inputs with the "naive" backend (the token recurrence) on the same values in fp32, for the
output, the final state and every gradient, on a small odd-length batch and on a packed varlen batch. An op may
name baselines (other backends of the same op, e.g. hla2's two-pass composition beside its fused kernel): they
are checked and timed in rows of their own. Times are medians of triton.testing.do_bench in ms. --settings
FAMILY.SETTING=V1,V2,... (the launch settings of hilo_kernels/common/launch.py, docs/kernel_settings.md) checks and times
the ops once per combination of the values given, inside launch_settings, each row labelled with its combination:
the way to tune a kernel's launch for another GPU. Imports only torch, triton and kernels.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hilo_kernels.common import checks, launch_settings
from hilo_kernels.common.checks import CASES, check, make_leaves, variants
from hilo_kernels.common.launch import check_settings


def _sdpa_fn(backend_name, b, t, h, d, device):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
    q, k, v = (torch.randn(b, h, t, d, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(b, h, t, d, device=device, dtype=torch.bfloat16)

    def fwd():
        with sdpa_kernel(kind):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd():
        fwd().backward(do)

    return fwd, fwd_bwd, [q, k, v]


def _op_fn(case, b, t, h, d, device, backend=None):
    backend = backend or case.backend
    x = make_leaves(case.make(b, t, h, d, device, seed=0), torch.bfloat16)
    o, _ = case.call(x, None, backend)
    do = torch.randn_like(o)

    def fwd():
        return case.call(x, None, backend)

    def fwd_bwd():
        o, _ = case.call(x, None, backend)
        o.backward(do)

    return fwd, fwd_bwd, list(x.values())


def _setting_value(text: str):
    """One value of --settings: an int, true / false, or none (the setting's head-size rule)."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    try:
        return int(lowered)
    except ValueError:
        raise ValueError(f"--settings value {text!r}: expected an integer, true, false or none") from None


def parse_settings(specs: list[str]) -> list[dict]:
    """--settings FAMILY.SETTING=V1,V2 ... as the launch_settings overrides of every combination of the values, in
    order ([{}] when none is given). Each combination is checked here (launch.check_settings), so an unknown family
    or setting, or a value of the wrong type, fails before anything runs, with a message naming the valid ones."""
    axes, seen = [], set()
    for spec in specs:
        key, eq, values = spec.partition("=")
        family, dot, name = key.strip().partition(".")
        if not (eq and dot and family and name and values.strip()):
            raise ValueError(f"--settings {spec!r}: expected FAMILY.SETTING=V1[,V2...], e.g. delta_rule.grads_warps=4,8")
        if (family, name) in seen:
            raise ValueError(f"--settings {family}.{name} is given twice: list all its values in one, comma-separated")
        seen.add((family, name))
        axes.append((family, name, [_setting_value(v) for v in values.split(",")]))
    combos = []
    for values in itertools.product(*(axis[2] for axis in axes)):
        combo: dict[str, dict] = {}
        for (family, name, _), value in zip(axes, values, strict=True):
            combo.setdefault(family, {})[name] = value
        check_settings(**combo)
        combos.append(combo)
    return combos


def settings_label(combo: dict) -> str:
    """A combination as rows show it: "grads_warps=8 grads_stages=2" ("" for the defaults)."""
    return " ".join(f"{name}={value}" for fields in combo.values() for name, value in fields.items())


def bench(ops, seqlens, tokens, heads, dim, device, tag: str = "", sdpa: bool = True):
    import triton.testing

    rows = []
    for t in seqlens:
        b = max(tokens // t, 1)
        entries = [(label, (lambda op=op, backend=backend, b=b, t=t: _op_fn(CASES[op], b, t, heads, dim, device,
                                                                             backend)))
                   for op in ops for label, backend in variants(op, CASES[op])]
        entries += [(f"sdpa_{kind}", (lambda kind=kind, b=b, t=t: _sdpa_fn(kind, b, t, heads, dim, device)))
                    for kind in ("flash", "cudnn") if sdpa]
        for label, build in entries:
            label = f"{label} [{tag}]" if tag and not label.startswith("sdpa_") else label  # SDPA has no hilo settings
            try:
                fwd, fwd_bwd, leaves = build()
                f = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
                fb = triton.testing.do_bench(fwd_bwd, warmup=25, rep=100, grad_to_none=leaves,
                                             return_mode="median")
                rows.append((t, b, label, f, fb))
                print(f"| {t} | {b} | {label} | {f:.3f} | {fb:.3f} |", flush=True)
            except Exception as e:  # noqa: BLE001 (a backend missing here, or out of resources, is reported, not fatal)
                rows.append((t, b, label, float("nan"), float("nan")))
                print(f"  {label} T={t}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            torch.cuda.empty_cache()
    return rows


def profile(ops, seqlen, tokens, heads, dim, device):
    """CUDA time per kernel of one forward+backward (torch.profiler), to see where the time goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    b = max(tokens // seqlen, 1)
    runs = [(name, label, backend) for name in ops for label, backend in variants(name, CASES[name])]
    for op, label, backend in runs:
        _, fwd_bwd_once, leaves = _op_fn(CASES[op], b, seqlen, heads, dim, device, backend)

        def fwd_bwd(step=fwd_bwd_once, leaves=leaves):
            # fresh gradients each call, as do_bench's grad_to_none: accumulating them would add an elementwise
            # kernel per input to every call (three of ~92 us each at 16K x 2 on the H200)
            for x in leaves:
                x.grad = None
            step()

        for _ in range(3):
            fwd_bwd()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            fwd_bwd()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / 5 * 1e3
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fwd_bwd()
            torch.cuda.synchronize()
        # kernel time well under the wall time: the call is bound by the host (launches, syncs), not the GPU
        busy = sum(e.self_device_time_total for e in prof.key_averages()) / 5 / 1e3
        print(f"{label} T={seqlen} B={b}: wall {wall:.2f} ms per forward+backward, GPU kernels {busy:.2f} ms; "
              f"CUDA time per kernel over 5 calls")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--seqlens", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dim-v", type=int, default=None,
                   help="value head dim of the timings and profile (default --dim; the ops take up to 256, the "
                        "delta rules up to 512: Gated DeltaNet 340m's V = 512 is one call)")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--profile", type=int, default=0, metavar="T", help="also profile one fwd+bwd at this T")
    p.add_argument("--also-backends", nargs="+", default=[], metavar="BACKEND",
                   help="check and time these backends of every op too (e.g. torch), as rows OP_BACKEND")
    p.add_argument("--settings", nargs="+", default=[], metavar="FAMILY.SETTING=V1,V2",
                   help="launch settings to sweep (hilo_kernels/common/launch.py): every combination is checked and timed")
    args = p.parse_args(argv)
    try:
        combos = parse_settings(args.settings)
    except ValueError as err:
        p.error(str(err))
    for name in args.ops:
        CASES[name] = dataclasses.replace(CASES[name], baselines={
            **CASES[name].baselines, **{f"{name}_{b}": b for b in args.also_backends if b != CASES[name].backend}})
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/operators.py needs a CUDA GPU")
    device = "cuda"
    failed = False
    for i, combo in enumerate(combos):
        tag = settings_label(combo)
        if tag:
            print(f"\n## launch settings: {tag}", flush=True)
        with launch_settings(**combo):
            failed |= run(args, device, tag, sdpa=i == 0)  # SDPA's rows once: hilo's settings do not touch it
    return 1 if failed else 0


def run(args, device: str, tag: str, sdpa: bool = True) -> bool:
    """Check, time (beside SDPA when sdpa) and profile args.ops under the launch settings in effect; True when a check
    failed."""
    failed = False
    checks.VALUE_DIM = None  # the check's own shapes
    if not args.skip_check:
        print("| op | case | quantity | error ratio | tolerance | ok |\n|---|---|---|---|---|---|", flush=True)
        for op in args.ops:  # rows are printed as each op finishes, so a later crash or timeout keeps them
            for label, qty, err, tol in check(op, CASES[op], device):
                ok = err <= tol
                failed |= not ok
                print(f"| {op} | {label} | {qty} | {err:.2e} | {tol:.0e} | {'yes' if ok else 'NO'} |", flush=True)
    checks.VALUE_DIM = args.dim_v
    if not args.skip_bench:
        print("\n| T | B | kernel | fwd ms | fwd+bwd ms |\n|---|---|---|---|---|", flush=True)
        bench(args.ops, args.seqlens, args.tokens, args.heads, args.dim, device, tag, sdpa)  # prints rows as measured
    if args.profile:
        profile(args.ops, args.profile, args.tokens, args.heads, args.dim, device)
    return failed


if __name__ == "__main__":
    sys.exit(main())
