"""One operator under several build-option variants in one process: for each variant, benchmarks/kernels.py's bf16
check against the fp32 oracle and the fwd / fwd+bwd time (do_bench medians) at one shape, as one table.

    python benchmarks/option_sweep.py --op loglinear_delta_rule --seq-len 16384 \\
        --variants "" "HILO_LOGLINEAR=scan_cols=64,scan_levels=4" "HILO_LOGLINEAR_DELTA=glue=eager"
    python benchmarks/option_sweep.py --op hla2 --variants "" "HILO_HLA=lowp_out=1" --skip-check --append

A variant is what the environment would say at import, as `VAR=spec` entries joined by ";" (VAR one of READERS;
"" is the defaults). Every variant starts from the defaults the process began with: the OPTIONS dicts are restored,
the named variables set (the others unset) and each module's own reader applied, so a bad spec fails as it would at
import. Triton and inductor compile each variant's kernels on its first call; "first call s" is that call's wall time
(the check's, or the first timing's with --skip-check). --heads, --dim, --dim-v and --tokens as in kernels.py.

--rounds N times every variant N times, round after round through all of them (the first round also checks), so
that a difference of a few percent is not one moment of the GPU against another: the table then gives each
variant's median over the rounds, and every round's fwd+bwd in a last column.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# environment variable -> (module, its reader of that variable, its OPTIONS dict's name)
READERS = {"HILO_LOGLINEAR": ("kernels.loglinear_attn.triton_fwd", "_apply_env_options"),
           "HILO_LOGLINEAR_DELTA": ("kernels.loglinear_delta_rule.triton_bwd", "_read_options"),
           "HILO_HLA": ("kernels.hla.triton_fused", "_read_options"),
           "HILO_DELTA_RULE": ("kernels.delta_rule.triton_fwd", "_apply_env_options"),
           "HILO_LINEAR_ATTN": ("kernels.linear_attn.triton_fwd", "_read_options")}


def parse_variant(text: str) -> dict[str, str]:
    """'VAR=spec;VAR2=spec2' -> {VAR: spec}; '' -> {} (the defaults)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        var, sep, spec = part.partition("=")
        if not sep or var not in READERS:
            raise SystemExit(f"option_sweep: variant entry {part!r}: expected VAR=spec with VAR one of "
                             f"{sorted(READERS)}")
        out[var] = spec
    return out


class OptionState:
    """The OPTIONS dicts of READERS' modules, snapshotted at start; apply(variant) restores them, then applies the
    variant through the modules' own readers."""

    def __init__(self):
        self.modules = {var: importlib.import_module(mod) for var, (mod, _) in READERS.items()}
        self.saved = {var: copy.deepcopy(m.OPTIONS) for var, m in self.modules.items()}

    def apply(self, variant: dict[str, str]) -> None:
        for var, module in self.modules.items():
            module.OPTIONS.clear()
            module.OPTIONS.update(copy.deepcopy(self.saved[var]))
            if var in variant:
                os.environ[var] = variant[var]
            else:
                os.environ.pop(var, None)
            getattr(module, READERS[var][1])()


def _check(kb, op: str, case, text: str) -> tuple[str, bool]:
    """kernels.py's bf16 check of the op under the options in force: (the table's verdict, whether a bound failed);
    every quantity's ratio goes to the log (the table keeps the worst: what a variant moves is not always it)."""
    rows = kb.check(op, case, "cuda")
    rows = [row for row in rows if "(" not in row[0]]  # the op's own backend, not its baselines
    bad = [f"{shape} {q} {e:.2e} > {tol}" for shape, q, e, tol in rows if not e <= tol]
    worst = max(rows, key=lambda row: row[2] / row[3])
    print(f"  {text or '(defaults)'}: " + "; ".join(f"{shape} {q} {e:.2e}" for shape, q, e, _ in rows), flush=True)
    return ("ok" if not bad else "FAIL: " + "; ".join(bad)) + f" ({worst[1]} {worst[2]:.2e} / {worst[3]})", bool(bad)


def _row(text: str, verdict: str, fwd: float, fwd_bwd: float, first: float) -> str:
    return f"| `{text or '(defaults)'}` | {verdict} | {fwd:.3f} | {fwd_bwd:.3f} | {first:.0f} |"


def main(argv=None) -> int:
    import torch
    import triton.testing

    from benchmarks import kernels as kb

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", required=True, choices=list(kb.CASES))
    ap.add_argument("--variants", nargs="+", required=True)
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dim-v", type=int, default=None)
    ap.add_argument("--backend", default=None,
                    help="run the op on this backend instead of its own (triton: the HLA ops' compositions)")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--rounds", type=int, default=1, help="time every variant this many times, round after round")
    ap.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    variants = [(v, parse_variant(v)) for v in args.variants]
    state = OptionState()
    for _, variant in variants:  # every spec through its module's reader before any GPU work: a bad one fails now
        state.apply(variant)
    state.apply({})
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/option_sweep.py needs a CUDA GPU")
    case = kb.CASES[args.op]
    if args.backend:
        case = dataclasses.replace(case, backend=args.backend, baselines={})
    b = max(args.tokens // args.seq_len, 1)
    if args.rounds < 1:
        raise SystemExit(f"option_sweep: --rounds {args.rounds}: give 1 or more")
    rounds = args.rounds > 1
    lines = ["| variant | check (worst quantity: ratio / tol) | fwd ms | fwd+bwd ms | first call s |"
             + (" fwd+bwd by round |" if rounds else ""), "|---|---|---|---|---|" + ("---|" if rounds else "")]
    print("\n".join(lines), flush=True)
    failed = False
    verdicts, firsts, times = {}, {}, {text: [] for text, _ in variants}
    for r in range(args.rounds):
        for text, variant in variants:
            state.apply(variant)
            kb.VALUE_DIM = None  # the check's shapes use V = D
            t0 = time.time()
            if r == 0:
                verdicts[text], bad = ("not run", False) if args.skip_check else _check(kb, args.op, case, text)
                failed |= bad
            kb.VALUE_DIM = args.dim_v
            fwd, fwd_bwd, leaves = kb._op_fn(case, b, args.seq_len, args.heads, args.dim, "cuda")
            fwd()
            torch.cuda.synchronize()
            if r == 0:
                firsts[text] = time.time() - t0
            f = triton.testing.do_bench(fwd, warmup=10, rep=60, return_mode="median")
            fb = triton.testing.do_bench(fwd_bwd, warmup=10, rep=60, grad_to_none=leaves, return_mode="median")
            times[text].append((f, fb))
            if rounds:
                print(f"  round {r + 1} {text or '(defaults)'}: fwd {f:.3f} fwd+bwd {fb:.3f}", flush=True)
            else:
                lines.append(_row(text, verdicts[text], f, fb, firsts[text]))
                print(lines[-1], flush=True)
            del fwd, fwd_bwd, leaves
            torch.cuda.empty_cache()
    if rounds:
        for text, _ in variants:
            f = statistics.median(t[0] for t in times[text])
            fb = statistics.median(t[1] for t in times[text])
            lines.append(_row(text, verdicts[text], f, fb, firsts[text])
                         + " " + " / ".join(f"{t[1]:.3f}" for t in times[text]) + " |")
            print(lines[-1], flush=True)
    state.apply({})  # the defaults back, for a caller in the same process
    if args.append:
        kb.append_results("Option sweep", "option_sweep.py",
                          f"{args.op} ({case.backend}), bf16, T = {args.seq_len}, B = {b}, H = {args.heads}, "
                          f"K = {args.dim}, V = {args.dim_v or args.dim}; medians of do_bench.", lines)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
