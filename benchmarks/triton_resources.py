"""Ahead-of-time resource audit of every Triton kernel in kernels/ for sm_90 (the H200): shared memory, registers and
spills of each launch configuration the wrappers actually use, with no GPU; "/SM" is how many such programs fit on
one multiprocessor at once (benchmarks/occupancy.py).

Run it with the H200's Triton (3.6.0; the venv's newer Triton allocates shared memory differently, e.g. the
log-linear delta rule's backward scan: 197 KB under 3.9, 288 KB under 3.6):

    PYTHONPATH=/tmp/tr36env/site .venv/bin/python benchmarks/triton_resources.py            # everything
    PYTHONPATH=/tmp/tr36env/site .venv/bin/python benchmarks/triton_resources.py --family loglinear_delta_rule \
        --dims 128x128,256x512 --dtypes bf16

(/tmp/tr36env/site is an unpacked triton==3.6.0 wheel; any Triton 3.6 install works.)

How: nothing duplicates the wrappers' tile logic. `JITFunction.run` (what `kernel[grid](...)` calls) is replaced by a
recorder, and each family's public entry point runs forward and backward on meta tensors (shapes only, no data, no
device) with backend "triton" / "fused": every launch the wrappers make is recorded with its arguments, constexprs
(block sizes chosen by the wrappers' own helpers for that dtype and head size), num_warps and num_stages, and is then
compiled for GPUTarget("cuda", 90, 64) with triton.compile(ASTSource(...)). Shared bytes come from the compiled
metadata, registers and spill stack from `cuobjdump -res-usage` on the cubin. "OVER" marks shared > 232448 bytes
(sm_90's per-block limit); such a launch raises OutOfResources on the H200.

Shapes: B = 1, H = 4, T = 64 * 257 tokens (nine chunk levels, so the log-linear scans launch both a full level group
and the remainder), with an initial state (log-linear: one that starts mid-chunk, so the prior-level scans run too)
and output_final_state=True. Limits: integer arguments are compiled as plain i32 (the launcher would also specialise
multiples of 16), pointers as 16-byte aligned; tile choices that depend on the CUDA device's multiprocessor count
(kernels.delta_rule.triton_fwd.state_block_v halves its V-block on small grids) take their largest value here, which
is the worst case for shared memory; linear_attn / hla halve their V-block on small grids too (n * H = 4 is small, so
this audit sees those narrower tiles; at many heads the 64-wide block is used: --heads 64 shows it).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
os.environ.pop("TRITON_INTERPRET", None)  # real JITFunctions, not the interpreter
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

# the entry points import their Triton modules lazily: import them all now, before TRITON_INTERPRET is set below
import kernels.delta_rule.triton_bwd
import kernels.hla.triton_fused
import kernels.linear_attn.triton_bwd
import kernels.short_conv.triton  # noqa: F401
from benchmarks.occupancy import programs_per_sm
from kernels import delta_rule, linear_attn, loglinear_attn, loglinear_delta_rule
from kernels.hla import ahla, hla2, hla3
from kernels.loglinear_attn import LogLinearState, num_levels
from kernels.loglinear_attn.triton_bwd import loglinear_attn_triton
from kernels.loglinear_delta_rule.triton_bwd import loglinear_delta_rule_triton
from kernels.short_conv.triton import short_conv_triton

# kernels.common.precision.autocast_off asks torch about autocast on the inputs' device, which "meta" is not: call
# the undecorated functions (functools.wraps keeps them as __wrapped__)
delta_rule, linear_attn, loglinear_attn, loglinear_delta_rule, ahla, hla2 = (
    getattr(f, "__wrapped__", f) for f in (delta_rule, linear_attn, loglinear_attn, loglinear_delta_rule, ahla, hla2))

# the public entry points refuse backend="triton" on non-CUDA tensors unless this is set; it is read at call time,
# while the kernels were decorated above without it (so they are JITFunctions, whose run() we record)
os.environ["TRITON_INTERPRET"] = "1"

MAX_SHARED = 232448

TARGET = GPUTarget("cuda", 90, 64)
DIMS = ((128, 128), (64, 64), (128, 64), (256, 512), (32, 16), (32, 64), (16, 32))
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TORCH_TO_TRITON = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
                   torch.int64: "i64", torch.bool: "i1", torch.float64: "fp64"}
SHAPE_NAMES = {"H", "K", "V", "C", "BT", "DX", "DY"}  # constexprs that are shapes, not tile choices

_launches: list = []


def _record(self, *args, grid, warmup, **kwargs):
    """Stand-in for JITFunction.run: keep (kernel, bound arguments, options) and launch nothing."""
    opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "num_ctas", "maxnreg") if k in kwargs}
    bound = dict(zip(self.arg_names, args))
    bound.update(kwargs)
    _launches.append((self, bound, opts))


JITFunction.run = _record


def _signature(fn: JITFunction, bound: dict):
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        name = p.name
        val = bound.get(name, p.default if p.has_default else None)
        if p.is_constexpr:
            sig[name], consts[name] = "constexpr", val
        elif val is None:
            sig[name], consts[name] = "constexpr", None
        elif isinstance(val, torch.Tensor):
            sig[name] = "*" + TORCH_TO_TRITON[val.dtype]
            if not p.do_not_specialize_on_alignment:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(val, bool):
            sig[name] = "i1"
        elif isinstance(val, int):
            sig[name] = "i32" if -2**31 <= val < 2**31 else "i64"
            # as the JIT launcher does: an integer it may specialize is known divisible by 16 when it is (a stride
            # that lets address arithmetic vectorize); 1 would become a constant, which no launch here passes
            if not p.do_not_specialize and not p.do_not_specialize_on_alignment and val % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(val, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(val).__name__}")
    return sig, consts, attrs


def _summary(consts: dict, opts: dict) -> str:
    parts = []
    for name, val in consts.items():
        if val is None or name in SHAPE_NAMES:
            continue
        if isinstance(val, bool):
            if val:
                parts.append(name)
        else:
            parts.append(f"{name}={val}")
    parts.append(f"w{opts.get('num_warps', 4)}s{opts.get('num_stages', 3)}"
                 + (f"r{opts['maxnreg']}" if opts.get("maxnreg") else ""))
    return " ".join(parts)


def _cuobjdump() -> str:
    base = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return os.path.join(base, "cuobjdump")


def compile_one(fn: JITFunction, sig: dict, consts: dict, attrs: dict, opts: dict) -> dict:
    """Compile for sm_90; shared bytes, registers and spill stack (bytes), or the error."""
    options = {"num_warps": opts.get("num_warps", 4), "num_stages": opts.get("num_stages", 3)}
    if opts.get("maxnreg"):
        options["maxnreg"] = opts["maxnreg"]
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=TARGET,
                           options=options)
    except Exception as e:  # noqa: BLE001 (report any compiler failure as a row)
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"}
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    try:
        out = subprocess.run([_cuobjdump(), "-res-usage", f.name], check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return {"shared": int(k.metadata.shared), "regs": int(regs.group(1)) if regs else -1,
            "spill": int(stack.group(1)) if stack else -1}


# ---- the calls: each family's public entry point, forward + backward, on meta tensors -------------------------------
# (the log-linear ones: their "triton" backend function, as the entry point calls it; the entry point's input check
# reads the initial levels' values, which meta tensors have not)

_device = ["meta"]


def _leaf(*shape, dtype):
    return torch.randn(*shape, device=_device[0], dtype=dtype).requires_grad_()


def _backward(o, state_tensors):
    loss = o.float().sum()
    for s in state_tensors:
        if s is not None:
            loss = loss + s.float().sum()
    loss.backward()


def call_linear_attn(dk, dv, dtype, b, t, h):
    q, k = _leaf(b, t, h, dk, dtype=dtype), _leaf(b, t, h, dk, dtype=dtype)
    v, g = _leaf(b, t, h, dv, dtype=dtype), _leaf(b, t, h, dtype=torch.float32)
    h0 = _leaf(b, h, dk, dv, dtype=torch.float32)
    o, ht = linear_attn(q, k, v, g, initial_state=h0, output_final_state=True, backend="triton")
    _backward(o, [ht])


def call_delta_rule(dk, dv, dtype, b, t, h):
    q, k = _leaf(b, t, h, dk, dtype=dtype), _leaf(b, t, h, dk, dtype=dtype)
    v, g = _leaf(b, t, h, dv, dtype=dtype), _leaf(b, t, h, dtype=torch.float32)
    beta = _leaf(b, t, h, dtype=dtype)
    h0 = _leaf(b, h, dk, dv, dtype=torch.float32)
    o, ht = delta_rule(q, k, v, beta, g, initial_state=h0, output_final_state=True, backend="triton")
    _backward(o, [ht])


def _loglinear_inputs(dk, dv, dtype, b, t, h):
    q, k = _leaf(b, t, h, dk, dtype=dtype), _leaf(b, t, h, dk, dtype=dtype)
    v, g = _leaf(b, t, h, dv, dtype=dtype), _leaf(b, t, h, dtype=torch.float32)
    p0 = 3 * 64 + 5  # an initial state that ends mid-chunk: the prior-level scans run (mode 1)
    nl = num_levels(p0 + t)
    lam = _leaf(b, t, h, nl, dtype=dtype)
    init = LogLinearState(_leaf(b, h, nl, dk, dv, dtype=torch.float32), torch.full((b,), p0, dtype=torch.int64))
    return q, k, v, g, lam, init


def call_loglinear_attn(dk, dv, dtype, b, t, h):
    q, k, v, g, lam, init = _loglinear_inputs(dk, dv, dtype, b, t, h)
    o, fin = loglinear_attn_triton(q, k, v, g, lam, dk ** -0.5, init, True, None, init.tokens.tolist())
    _backward(o, [fin])


def call_loglinear_delta_rule(dk, dv, dtype, b, t, h):
    q, k, v, g, lam, init = _loglinear_inputs(dk, dv, dtype, b, t, h)
    beta = _leaf(b, t, h, dtype=dtype)
    o, fin = loglinear_delta_rule_triton(q, k, v, beta, g, lam, dk ** -0.5, init, True, None, init.tokens.tolist())
    _backward(o, [fin])


def call_hla_fused(dk, dv, dtype, b, t, h):
    for op in (hla2, ahla):
        q, k = _leaf(b, t, h, dk, dtype=dtype), _leaf(b, t, h, dk, dtype=dtype)
        v, g = _leaf(b, t, h, dv, dtype=dtype), _leaf(b, t, h, dtype=torch.float32)
        o, st = op(q, k, v, g, output_final_state=True, backend="fused")
        _backward(o, list(st))


def call_hla_one_op(dk, dv, dtype, b, t, h):
    """hla2's and hla3's passes as one op (the default; forced here): linear_attn's kernels with the earlier passes'
    backward accumulating dq (hla3's middle pass: ACC_DQ alone) and the first's dk + dv as well (ACC_DQ SELF_V).
    Keys wider than one tile, and for hla3 values too, take the separate passes."""
    from kernels.hla import triton_fused

    saved = triton_fused.OPTIONS["one_op"]
    triton_fused.OPTIONS["one_op"] = True
    try:
        for op in (hla2, hla3):
            q, k = _leaf(b, t, h, dk, dtype=dtype), _leaf(b, t, h, dk, dtype=dtype)
            v, g = _leaf(b, t, h, dv, dtype=dtype), _leaf(b, t, h, dtype=torch.float32)
            o, _ = op(q, k, v, g, backend="triton")
            _backward(o, [])
    finally:
        triton_fused.OPTIONS["one_op"] = saved


def call_short_conv(dk, dv, dtype, b, t, h):
    """C = H * K channels, K = 4 taps, with a bias and an initial state, SiLU; with neither (the shells' training
    path); then packed documents."""
    c = h * dk
    x, w, bias, st = _leaf(b, t, c, dtype=dtype), _leaf(c, 4, dtype=torch.float32), _leaf(c, dtype=torch.float32), \
        _leaf(b, c, 3, dtype=dtype)
    _backward(short_conv_triton(x, w, bias, st, None, True), [])
    _backward(short_conv_triton(x, w, None, None, None, True), [])
    cu = torch.tensor([0, t // 3, t], device=x.device)
    _backward(short_conv_triton(x[:1], w, bias, None, cu, False), [])


# linear_attn, delta_rule, hla and short_conv copy host data out of their inputs (short_conv: a custom op, which on meta
# tensors would run its fake instead): they run on small CPU tensors (T = 256; their tiles do not depend on T), the
# log-linear families on meta tensors at the full T
ON_CPU = {"linear_attn", "delta_rule", "hla_fused", "hla_one_op", "short_conv"}
FAMILIES = {"linear_attn": call_linear_attn, "delta_rule": call_delta_rule, "loglinear_attn": call_loglinear_attn,
            "loglinear_delta_rule": call_loglinear_delta_rule, "hla_fused": call_hla_fused,
            "hla_one_op": call_hla_one_op, "short_conv": call_short_conv}


def collect(family, dk, dv, dtype, b, t, h):
    """The distinct compiled variants one forward + backward of `family` launches: [(fn, sig, consts, attrs, opts)]."""
    _launches.clear()
    _device[0] = "cpu" if family in ON_CPU else "meta"
    FAMILIES[family](dk, dv, dtype, b, min(t, 256) if family in ON_CPU else t, h)
    seen, out = set(), []
    for fn, bound, opts in _launches:
        sig, consts, attrs = _signature(fn, bound)
        key = (fn.__name__, tuple(sorted(sig.items())), tuple(sorted((k, str(v)) for k, v in consts.items())),
               tuple(sorted(opts.items())))
        if key not in seen:
            seen.add(key)
            out.append((fn, sig, consts, attrs, opts))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default=",".join(FAMILIES), help="comma-separated subset of " + ",".join(FAMILIES))
    ap.add_argument("--dims", default=",".join(f"{k}x{v}" for k, v in DIMS), help="KxV,KxV,...")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64 * 257)
    ap.add_argument("--over-only", action="store_true", help="print only rows over the limit (and errors)")
    args = ap.parse_args()
    dims = [tuple(int(x) for x in d.split("x")) for d in args.dims.split(",")]
    print(f"triton {triton.__version__}, target sm_90, shared limit {MAX_SHARED} B, B=1 T={args.tokens} "
          f"H={args.heads}")
    if not triton.__version__.startswith("3.6"):
        print(f"WARNING: Triton {triton.__version__}, not the H200's 3.6: shared memory may differ (see docstring)")
    header = (f"{'kernel':<26} {'dtype':<5} {'K':>4} {'V':>4}  {'shared':>7} {'regs':>4} {'spill':>5} {'/SM':>3}  "
              f"{'':4} config")
    print(header)
    print("-" * len(header))
    n_over = n_err = 0
    for family in args.family.split(","):
        for dname in args.dtypes.split(","):
            for dk, dv in dims:
                try:
                    variants = collect(family, dk, dv, DTYPES[dname], 1, args.tokens, args.heads)
                except ValueError as e:
                    if "head dims" not in str(e):
                        raise
                    print(f"{family:<26} {dname:<5} {dk:>4} {dv:>4}  (not supported: {e})")
                    continue
                except Exception as e:  # noqa: BLE001
                    n_err += 1
                    print(f"{family:<26} {dname:<5} {dk:>4} {dv:>4}  wrapper failed: {type(e).__name__}: {e}")
                    continue
                for fn, sig, consts, attrs, opts in variants:
                    r = compile_one(fn, sig, consts, attrs, opts)
                    cfg = _summary(consts, opts)
                    if "error" in r:
                        n_err += 1
                        print(f"{fn.__name__:<26} {dname:<5} {dk:>4} {dv:>4}  {'ERROR':>7} {'':>4} {'':>5} {'':>3}  "
                              f"{'':4} {cfg}  {r['error']}")
                        continue
                    over = r["shared"] > MAX_SHARED
                    n_over += over
                    if args.over_only and not over:
                        continue
                    per_sm = programs_per_sm(r["regs"], r["shared"], opts.get("num_warps", 4))
                    print(f"{fn.__name__:<26} {dname:<5} {dk:>4} {dv:>4}  {r['shared']:>7} {r['regs']:>4} "
                          f"{r['spill']:>5} {per_sm:>3}  {'OVER' if over else '':4} {cfg}", flush=True)
    print(f"{n_over} launch(es) over {MAX_SHARED} B of shared memory, {n_err} error(s)")
    return 1 if n_over or n_err else 0


if __name__ == "__main__":
    sys.exit(main())
