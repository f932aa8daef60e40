"""HLA numerics in low precision: output magnitude against position and the error of bf16 against fp32, with and
without decay, for hla2 (decay conventions "d1" and "d2"), ahla and hla3 (docs/kernels.md).

    python benchmarks/hla_numerics.py                        # CUDA: T = 32768, H = 4, D = 128, default backends
    python benchmarks/hla_numerics.py --backends fused triton --ops hla2 ahla
    python benchmarks/hla_numerics.py --device cpu           # T = 512, backend "torch": seconds

Inputs as the HLA layer (models.mixers.hla) feeds the operator: B = 1; q, k, v standard normal; with normalize,
the feature map elu + 1 on q and k; q and k L2-normalised per head (scale 1); v as drawn. Decay: none (g = None),
or a per-token, per-head log decay g = -s * softplus(z), z standard normal, with s set so that the mean of g is
log(alpha) exactly (alpha = the --decays value: the geometric-mean per-token decay; 1 / (1 - alpha) tokens of
memory). Every configuration runs the op on the same values four times:
  low   in --dtype (q, k, v cast; g fp32), on the backend;
  fp32  in fp32, on the same backend (the reference of the error columns);
  fp32 of the rounded inputs: the low-precision values upcast, on the same backend (isolates the kernel's own
        rounding from that of the inputs);
  fp64  on backend "torch" (the exact chunked composition) in float64: checks the fp32 reference itself.
Reported (magnitudes from the fp32 run): RMS of o over the first, middle and last `band` tokens; the growth
exponent p of RMS(o) ~ t^p between the middle and last bands; max |o|; the RMS of every final-state field;
error ratios (hilo_kernels.common.error_ratio: RMS(out - ref) / RMS(ref)) of low vs fp32 for o over the
whole sequence and in its worst band, of low vs fp32-of-rounded-inputs, of the final state (worst field) and of
fp32 vs fp64; whether o is within the bf16 check's tolerance (5e-3); any inf / nan in any run. --grad adds the
error ratios of dq, dk, dv (and dg with decay) of low vs fp32 for the loss sum(o * w), w a fixed normal tensor.

Backends: CUDA defaults to the operators' own defaults ("fused" for hla2 and ahla, "triton", the composition of
linear_attn kernels, for hla3); CPU to "torch". --backends runs each op on every listed backend that exists for
it ("fused" is hla2 / ahla only); "triton" and "fused" on CPU run under the Triton interpreter (slow). Rows are
printed as they are measured, so a run cut short keeps them. Imports torch, triton (when present), kernels and
models (the layer's l2_normalize).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# run as a script, this folder is sys.path[0]: the repository's packages are imported from REPO, ahead of the rest
sys.path.insert(0, str(REPO))

# label -> (kernels op, decay convention); hla2 "d2" equals "d1" without decay, so it has decayed rows only
OPS = {"hla2": ("hla2", "d1"), "hla2_d2": ("hla2", "d2"), "ahla": ("ahla", "d1"), "hla3": ("hla3", "d1")}
FUSED_OPS = ("hla2", "ahla")
BACKENDS = ("fused", "triton", "torch", "naive")
OUT_TOL = 5e-3  # outputs and final states, bf16 on GPU vs the fp32 oracle (hilo_kernels/common/checks.py)
GPU_DEFAULTS = {"seq_len": 32768, "heads": 4, "dim": 128}
CPU_DEFAULTS = {"seq_len": 512, "heads": 4, "dim": 128}
DEFAULT_DECAYS = ("none", "0.999", "0.99", "0.9")
DEFAULT_BAND = 1024


def parse_decay(text: str) -> float | None:
    """'none' -> None (g = None); else the mean per-token decay alpha in (0, 1)."""
    if text.lower() == "none":
        return None
    alpha = float(text)
    if not 0.0 < alpha < 1.0:
        raise argparse.ArgumentTypeError(f"a decay is 'none' or a mean per-token decay in (0, 1), got {text}")
    return alpha


def decay_label(alpha: float | None) -> str:
    return "none" if alpha is None else f"{alpha:g}"


@functools.lru_cache(maxsize=1)
def _draws(t: int, h: int, d: int, seed: int):
    """The standard normal draws behind make_inputs: q, k, v [1, T, H, D] and z [1, T, H] (CPU, fp32)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return (*(torch.randn(1, t, h, d, generator=gen) for _ in range(3)), torch.randn(1, t, h, generator=gen))


def make_inputs(t: int, h: int, d: int, normalize: bool, alpha: float | None, seed: int):
    """(q, k, v [1, T, H, D] fp32, g [1, T, H] fp32 or None) on the CPU, as the HLA layer prepares them (see the
    module docstring). The same seed gives the same draws for every configuration, so rows compare one input."""
    import torch.nn.functional as F

    from models.mixers.gated_deltanet import l2_normalize

    q, k, v, z = _draws(t, h, d, seed)
    if normalize:
        q, k = F.elu(q) + 1, F.elu(k) + 1
    q, k = l2_normalize(q), l2_normalize(k)
    g = None
    if alpha is not None:
        sp = F.softplus(z)
        g = sp * (math.log(alpha) / sp.mean())
    return q, k, v, g


def backends_for(op: str, requested: list[str] | None, on_gpu: bool) -> list[str]:
    """The backends op runs on: the requested ones that exist for it, or its default on the device."""
    if requested is None:
        if not on_gpu:
            return ["torch"]
        return ["fused" if op in FUSED_OPS else "triton"]
    return [b for b in requested if b != "fused" or op in FUSED_OPS]


def run_op(op: str, conv: str, q, k, v, g, normalize: bool, backend: str, weight=None):
    """op on (q, k, v, g) with its final state. weight given: also the gradients of sum(o * weight) with
    respect to q, k, v (and g); returns (o, state fields as a tuple, grads dict or None)."""
    import torch

    import hilo_kernels

    fn = getattr(hilo_kernels, op)
    if weight is None:
        with torch.no_grad():
            o, state = fn(q, k, v, g=g, decay=conv, normalize=normalize, output_final_state=True, backend=backend)
        return o, tuple(state), None
    leaves = {"q": q, "k": k, "v": v, **({} if g is None else {"g": g})}
    leaves = {n: x.detach().requires_grad_() for n, x in leaves.items()}
    o, state = fn(leaves["q"], leaves["k"], leaves["v"], g=leaves.get("g"), decay=conv, normalize=normalize,
                  output_final_state=True, backend=backend)
    grads = torch.autograd.grad((o.float() * weight).sum(), list(leaves.values()))
    return o.detach(), tuple(s.detach() for s in state), dict(zip(leaves, grads))


def bands(t: int, width: int) -> dict[str, tuple[int, int]]:
    """[start, end) of the first, middle and last `width` tokens (width clipped to T // 3, at least 1)."""
    w = max(1, min(width, t // 3))
    mid = max(0, t // 2 - w // 2)
    return {"first": (0, w), "mid": (mid, mid + w), "last": (t - w, t)}


def _rms(x) -> float:
    return float(x.double().pow(2).mean().sqrt())


def _finite(*xs) -> bool:
    import torch

    return all(bool(torch.isfinite(x).all()) for x in xs)


def measure(label: str, alpha: float | None, normalize: bool, backend: str, inputs, device, dtype, band: int,
            reference: bool = True, grad: bool = False, seed: int = 0) -> dict:
    """One row: op `label` (a key of OPS) on inputs (q, k, v, g: fp32 CPU tensors from make_inputs) on backend,
    in dtype against fp32 (see the module docstring)."""
    import torch

    from hilo_kernels.common import error_ratio
    from hilo_kernels.hla.state import STATE_TYPES

    op, conv = OPS[label]
    q, k, v, g = (None if x is None else x.to(device) for x in inputs)
    t = q.shape[1]
    start = time.perf_counter()
    weight = None
    if grad:
        gen = torch.Generator().manual_seed(seed + 1)
        weight = torch.randn(v.shape, generator=gen).to(device)
    lo = tuple(x.to(dtype) for x in (q, k, v))
    o_lo, s_lo, gr_lo = run_op(op, conv, *lo, g, normalize, backend, weight)
    o32, s32, gr32 = run_op(op, conv, q, k, v, g, normalize, backend, weight)
    o32r, _, _ = run_op(op, conv, *(x.float() for x in lo), g, normalize, backend)
    fp32_vs_fp64 = None
    finite = _finite(o_lo, *s_lo, o32, *s32, o32r)
    if reference:
        o64, s64, _ = run_op(op, conv, *(x.double() for x in (q, k, v)), None if g is None else g.double(),
                             normalize, "torch")
        fp32_vs_fp64 = error_ratio(o32, o64)
        finite &= _finite(o64, *s64)
    if grad:
        finite &= _finite(*gr_lo.values(), *gr32.values())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    spans = bands(t, band)
    rms = {name: _rms(o32[:, a:b]) for name, (a, b) in spans.items()}
    # t counts from 1: the growth exponent between the centres of the middle and last bands
    centre = {name: (a + b + 1) / 2 for name, (a, b) in spans.items()}
    growth = None
    if rms["mid"] > 0 and rms["last"] > 0 and centre["last"] > centre["mid"]:
        growth = math.log(rms["last"] / rms["mid"]) / math.log(centre["last"] / centre["mid"])
    fields = STATE_TYPES[op]._fields
    return {
        "op": label, "decay": decay_label(alpha), "normalize": normalize, "backend": backend,
        "dtype": str(dtype).removeprefix("torch."), "T": t, "H": q.shape[2], "D": q.shape[3],
        "band": spans["first"][1],
        "rms_first": rms["first"], "rms_mid": rms["mid"], "rms_last": rms["last"], "growth": growth,
        "max_abs": float(o32.abs().max()),
        "state_rms": {f: _rms(s) for f, s in zip(fields, s32, strict=True)},
        "err_o": error_ratio(o_lo, o32),
        "err_o_worst_band": max(error_ratio(o_lo[:, a:b], o32[:, a:b]) for a, b in spans.values()),
        "err_o_same_inputs": error_ratio(o_lo, o32r),
        "err_state": max(error_ratio(a, b) for a, b in zip(s_lo, s32, strict=True)),
        "err_fp32_vs_fp64": fp32_vs_fp64,
        "finite": finite,
        "grads": None if not grad else {n: error_ratio(gr_lo[n], gr32[n]) for n in gr32},
        "seconds": time.perf_counter() - start,
    }


def _e(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2e}"


def header(grad: bool) -> list[str]:
    cols = ["op", "decay", "normalize", "backend", "RMS o first", "RMS o mid", "RMS o last", "growth t^p",
            "max abs o", "final state RMS", "err o", "err o worst band", "err o same inputs", "err state",
            "fp32 vs fp64", f"o <= {OUT_TOL:g}", "inf/nan"]
    if grad:
        cols += ["err dq", "err dk", "err dv", "err dg"]
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]


def table_row(r: dict) -> str:
    op = "hla2 (d2)" if r["op"] == "hla2_d2" else r["op"]
    growth = "n/a" if r["growth"] is None else f"{r['growth']:.2f}"
    state = ", ".join(f"{f} {_e(x)}" for f, x in r["state_rms"].items())
    ok = "yes" if r["finite"] and r["err_o"] <= OUT_TOL else "NO"
    cells = [op, r["decay"], "yes" if r["normalize"] else "no", r["backend"], _e(r["rms_first"]), _e(r["rms_mid"]),
             _e(r["rms_last"]), growth, _e(r["max_abs"]), state, _e(r["err_o"]), _e(r["err_o_worst_band"]),
             _e(r["err_o_same_inputs"]), _e(r["err_state"]), _e(r["err_fp32_vs_fp64"]), ok,
             "none" if r["finite"] else "YES"]
    if r["grads"] is not None:
        cells += [_e(r["grads"].get(n)) for n in ("q", "k", "v", "g")]
    return "| " + " | ".join(cells) + " |"


def table(rows: list[dict], grad: bool) -> str:
    return "\n".join(header(grad) + [table_row(r) for r in rows])


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS),
                    help="hla2_d2 is hla2 with decay='d2' (decayed rows only)")
    ap.add_argument("--backends", nargs="+", default=None, choices=BACKENDS,
                    help="default: fused for hla2 / ahla and triton for hla3 on CUDA, torch on CPU")
    ap.add_argument("--seq-len", type=int, default=None, help="T (default: 32768 on CUDA, 512 on CPU)")
    ap.add_argument("--heads", type=int, default=None, help="H (default: 4)")
    ap.add_argument("--dim", type=int, default=None, help="D = K = V (default: 128)")
    ap.add_argument("--decays", nargs="+", type=parse_decay, default=[parse_decay(x) for x in DEFAULT_DECAYS],
                    help="'none' and/or mean per-token decays in (0, 1) (default: none 0.999 0.99 0.9)")
    ap.add_argument("--normalize", nargs="+", choices=["false", "true"], default=["false", "true"])
    ap.add_argument("--band", type=int, default=DEFAULT_BAND, help="tokens per position band (clipped to T // 3)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="the low precision compared with fp32")
    ap.add_argument("--no-reference", action="store_true", help="skip the float64 'torch' run (fp32 vs fp64)")
    ap.add_argument("--grad", action="store_true", help="also the error ratios of dq, dk, dv, dg (more memory)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)

    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    if not on_gpu and args.backends and {"triton", "fused"} & set(args.backends):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when kernels' Triton code is first imported
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    t = args.seq_len or defaults["seq_len"]
    h = args.heads or defaults["heads"]
    d = args.dim or defaults["dim"]
    if min(t, h, d) < 1:
        ap.error("--seq-len, --heads and --dim must be >= 1")
    dtype = getattr(torch, args.dtype)
    decays = list(dict.fromkeys(args.decays))
    normalizes = [x == "true" for x in dict.fromkeys(args.normalize)]

    lines = header(args.grad)
    print("\n".join(lines), flush=True)
    rows = []
    for normalize in normalizes:
        for alpha in decays:
            inputs = make_inputs(t, h, d, normalize, alpha, args.seed)
            for label in args.ops:
                if label == "hla2_d2" and alpha is None:
                    continue
                backends = backends_for(OPS[label][0], args.backends, on_gpu)
                if not backends:
                    print(f"{label}: none of --backends {' '.join(args.backends)} exists for it; skipped",
                          file=sys.stderr, flush=True)
                for backend in backends:
                    row = measure(label, alpha, normalize, backend, inputs, device, dtype, args.band,
                                  reference=not args.no_reference, grad=args.grad, seed=args.seed)
                    rows.append(row)
                    lines.append(table_row(row))
                    print(lines[-1], flush=True)
                    print(f"{label} decay {decay_label(alpha)} normalize {normalize} {backend}: "
                          f"{row['seconds']:.2f} s", file=sys.stderr, flush=True)
    print(f"\n{args.dtype} vs fp32 on the same backend, B=1 T={t} H={h} D={d}, q and k L2-normalised (elu + 1 first "
          f"with normalize), v normal, seed {args.seed}. Decay: the geometric-mean per-token decay exp(mean g) (none: "
          f"g = None). Magnitudes from the fp32 run; RMS bands of {rows[0]['band'] if rows else args.band} tokens; "
          "growth: p in RMS(o) ~ t^p between the middle and last bands. err: error ratios (docs/kernels.md) against "
          "fp32 on the fp32 inputs; 'same inputs': against fp32 on the rounded inputs (the kernel's own error); fp32 "
          "vs fp64: the fp32 run against backend torch in float64.")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
