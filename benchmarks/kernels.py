"""Kernel benchmark: bf16 correctness on the GPU against the fp32 oracle, then forward and forward+backward
times beside SDPA (flash and cuDNN backends) at SPEC §9's shapes (B*T = 32,768 tokens, 16 heads, head dim 128).

    python benchmarks/kernels.py                         # every op in CASES
    python benchmarks/kernels.py --ops linear_attn --seqlens 1024 4096 32768
    python benchmarks/kernels.py --append                # also writes the table to benchmarks/RESULTS.md

Each op is one entry of CASES (an OpCase): how to make its inputs, how to call it, and which gradients it
has with their SPEC §2 tolerances. Correctness compares the op's GPU backend (OpCase.backend, "triton" unless
named) on bf16 inputs with the "naive" backend (the token recurrence) on the same values in fp32, for the
output, the final state and every gradient, on a small odd-length batch and on a packed varlen batch. An op may
name baselines (other backends of the same op, e.g. hla2's two-pass composition beside its fused kernel): they
are checked and timed in rows of their own. Times are medians of triton.testing.do_bench in ms. Imports only
torch, triton and kernels.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kernels.common import error_ratio

OUT_TOL = 5e-3  # outputs and final states, bf16 vs the fp32 oracle (SPEC §2)
QKV_TOL = 1e-2
GATE_TOL = 2e-2


@dataclass
class OpCase:
    """make(B, T, H, D, device, seed) -> dict of fp32 input tensors (names in call order; g/beta fp32 always,
    'initial_state' [N, H, D, D] optional); call(inputs, cu_seqlens, backend) -> (o, final_state tensor).
    grad_tol maps each differentiable input name to its gradient tolerance. backend is the one checked and
    timed; baselines maps extra row labels to other backends of the same op, checked and timed beside it."""

    make: Callable[..., dict]
    call: Callable[..., tuple]
    grad_tol: dict = field(default_factory=dict)
    oracle: str = "naive"  # the log-linear ops: "torch" (their token recurrence is too slow at the check shapes)
    backend: str = "triton"
    baselines: dict = field(default_factory=dict)


# --dim-v: the value head dim of the timed and profiled calls (None: the same as q's and k's); the checks keep K = V
VALUE_DIM = None


def _qkv(b, t, h, d, device, gen):
    q = torch.randn(b, t, h, d, device=device, generator=gen)
    k = torch.randn(b, t, h, d, device=device, generator=gen)
    v = torch.randn(b, t, h, VALUE_DIM or d, device=device, generator=gen)
    return q, k, v


def _make_linear_attn(b, t, h, d, device, seed=0, n_state=None):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = _qkv(b, t, h, d, device, gen)
    # Mamba-2-like decays: g = -exp(A_log) * softplus(dt), per-token in (-0.3, 0)
    g = -0.3 * torch.rand(b, t, h, device=device, generator=gen)
    out = {"q": q, "k": k, "v": v, "g": g}
    if n_state is not None:
        out["initial_state"] = torch.randn(n_state, h, d, d, device=device, generator=gen)
    return out


def _call_linear_attn(x, cu_seqlens, backend):
    from kernels import linear_attn

    return linear_attn(x["q"], x["k"], x["v"], x["g"], initial_state=x.get("initial_state"),
                       output_final_state=True, cu_seqlens=cu_seqlens, backend=backend)


def _make_delta_rule(b, t, h, d, device, seed=0, n_state=None):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = _qkv(b, t, h, d, device, gen)
    # As the Gated DeltaNet layer feeds it: L2-normalised k, beta = sigmoid(.), g = -exp(A_log) * softplus(.).
    k = torch.nn.functional.normalize(k, dim=-1)
    beta = torch.rand(b, t, h, device=device, generator=gen).sigmoid()
    g = -0.3 * torch.rand(b, t, h, device=device, generator=gen)
    out = {"q": q, "k": k, "v": v, "beta": beta, "g": g}
    if n_state is not None:
        out["initial_state"] = torch.randn(n_state, h, d, d, device=device, generator=gen)
    return out


def _call_delta_rule(x, cu_seqlens, backend):
    from kernels import delta_rule

    return delta_rule(x["q"], x["k"], x["v"], x["beta"], x["g"], initial_state=x.get("initial_state"),
                      output_final_state=True, cu_seqlens=cu_seqlens, backend=backend)


def _make_hla(b, t, h, d, device, seed=0, n_state=None, fields=2):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = _qkv(b, t, h, d, device, gen)
    # As the HLA layer feeds it: L2-normalised q and k (scale 1), a Mamba-2-like per-token decay.
    q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    g = -0.3 * torch.rand(b, t, h, device=device, generator=gen)
    out = {"q": q, "k": k, "v": v, "g": g}
    if n_state is not None:  # the op's state fields (two; hla3 three) [N, H, D, D] side by side in one tensor
        out["initial_state"] = 0.1 * torch.randn(n_state, h, d, fields * d, device=device, generator=gen)
    return out


def _call_hla(op):
    def call(x, cu_seqlens, backend):
        import kernels
        from kernels.hla.state import STATE_TYPES

        h0 = x.get("initial_state")
        d = x["q"].shape[-1]
        h0 = None if h0 is None else STATE_TYPES[op](*h0.split(d, dim=-1))
        o, state = getattr(kernels, op)(x["q"], x["k"], x["v"], x["g"], initial_state=h0, output_final_state=True,
                                        cu_seqlens=cu_seqlens, backend=backend)
        return o, torch.cat(list(state), dim=-1)

    return call


PRIOR_TOKENS = 100  # log-linear checks: the initial state's sequences already consumed this many tokens


def _with_levels(x, b, t, h, d, device, gen, n_state):
    """Add level_scales (softplus-like values around 1) and, with n_state, the initial per-level state."""
    from kernels.loglinear_attn import num_levels

    nl = num_levels(t + (PRIOR_TOKENS if n_state is not None else 0))
    x.pop("initial_state", None)
    x["level_scales"] = 0.5 + torch.rand(b, t, h, nl, device=device, generator=gen)
    if n_state is not None:
        x["initial_levels"] = torch.randn(n_state, h, nl, d, d, device=device, generator=gen) / nl
    return x


def _prior(x):
    from kernels.loglinear_attn import LogLinearState

    levels = x.get("initial_levels")
    if levels is None:
        return None
    return LogLinearState(levels, torch.full((levels.shape[0],), PRIOR_TOKENS, device=levels.device))


def _make_loglinear_attn(b, t, h, d, device, seed=0, n_state=None):
    x = _make_linear_attn(b, t, h, d, device, seed, n_state)
    return _with_levels(x, b, t, h, d, device, torch.Generator(device=device).manual_seed(seed + 1), n_state)


def _call_loglinear_attn(x, cu_seqlens, backend):
    from kernels import loglinear_attn

    o, st = loglinear_attn(x["q"], x["k"], x["v"], x["g"], x["level_scales"], initial_state=_prior(x),
                           output_final_state=True, cu_seqlens=cu_seqlens, backend=backend)
    return o, st.levels


def _make_loglinear_delta_rule(b, t, h, d, device, seed=0, n_state=None):
    x = _make_delta_rule(b, t, h, d, device, seed, n_state)
    return _with_levels(x, b, t, h, d, device, torch.Generator(device=device).manual_seed(seed + 1), n_state)


def _call_loglinear_delta_rule(x, cu_seqlens, backend):
    from kernels import loglinear_delta_rule

    o, st = loglinear_delta_rule(x["q"], x["k"], x["v"], x["beta"], x["g"], x["level_scales"],
                                 initial_state=_prior(x), output_final_state=True, cu_seqlens=cu_seqlens,
                                 backend=backend)
    return o, st.levels


CASES: dict[str, OpCase] = {
    "linear_attn": OpCase(_make_linear_attn, _call_linear_attn,
                          {"q": QKV_TOL, "k": QKV_TOL, "v": QKV_TOL, "g": GATE_TOL, "initial_state": QKV_TOL}),
    "delta_rule": OpCase(_make_delta_rule, _call_delta_rule,
                         {"q": QKV_TOL, "k": QKV_TOL, "v": QKV_TOL, "beta": GATE_TOL, "g": GATE_TOL,
                          "initial_state": QKV_TOL}),
    "loglinear_attn": OpCase(_make_loglinear_attn, _call_loglinear_attn,
                             {"q": QKV_TOL, "k": QKV_TOL, "v": QKV_TOL, "g": GATE_TOL, "level_scales": GATE_TOL,
                              "initial_levels": QKV_TOL}, oracle="torch"),
    "loglinear_delta_rule": OpCase(_make_loglinear_delta_rule, _call_loglinear_delta_rule,
                                   {"q": QKV_TOL, "k": QKV_TOL, "v": QKV_TOL, "beta": GATE_TOL, "g": GATE_TOL,
                                    "level_scales": GATE_TOL, "initial_levels": QKV_TOL}, oracle="torch"),
    # the fused chunked kernels, with the two-pass compositions over linear_attn's Triton kernels beside them (bf16
    # passes for hla2, fp32 for ahla: kernels.hla.compose)
    **{op: OpCase(_make_hla, _call_hla(op),
                  {"q": QKV_TOL, "k": QKV_TOL, "v": QKV_TOL, "g": GATE_TOL, "initial_state": QKV_TOL},
                  backend="fused", baselines={f"{op}_compose": "triton"}) for op in ("hla2", "ahla")},
    # third order: the three-pass composition only (bf16 passes for bf16 inputs)
    "hla3": OpCase(functools.partial(_make_hla, fields=3), _call_hla("hla3"),
                   {"q": QKV_TOL, "k": QKV_TOL, "v": QKV_TOL, "g": GATE_TOL, "initial_state": QKV_TOL},
                   backend="triton"),
}


def _leaves(inputs, dtype):
    """Detached leaves requiring grad: q/k/v/beta-like activations in `dtype`, g and states in fp32."""
    out = {}
    for name, x in inputs.items():
        keep_fp32 = name in ("g", "initial_state", "level_scales", "initial_levels") or x.dtype != torch.float32
        out[name] = x.detach().to(torch.float32 if keep_fp32 else dtype).requires_grad_()
    return out


def _run_with_grads(case, inputs, cu, backend, dtype, seed=11):
    x = _leaves(inputs, dtype)
    o, s = case.call(x, cu, backend)
    gen = torch.Generator(device=o.device).manual_seed(seed)
    do = torch.randn(o.shape, device=o.device, generator=gen)
    ds = torch.randn(s.shape, device=o.device, generator=gen)
    loss = (o.float() * do).sum() + (s.float() * ds).sum()
    names = [n for n in x if n in case.grad_tol]
    grads = torch.autograd.grad(loss, [x[n] for n in names])
    return o, s, dict(zip(names, grads))


def _variants(name: str, case: OpCase) -> list[tuple[str, str]]:
    """(row label, backend) of the op's own backend and its baselines."""
    return [(name, case.backend), *case.baselines.items()]


def check(name: str, case: OpCase, device: str) -> list[tuple[str, str, float, float]]:
    """Rows (shape, quantity, error ratio, tolerance) for bf16 on the op's backend vs fp32 naive; the shape
    label names the baseline for a baseline's rows."""
    rows = []
    shapes = [("B2 T777 H4 D128", 2, 777, 4, 128, None), ("varlen 1,15,700,333 H4 D128", 1, 1049, 4, 128,
                                                             [0, 1, 16, 716, 1049])]
    for label, b, t, h, d, bounds in shapes:
        n = b if bounds is None else len(bounds) - 1
        cu = None if bounds is None else torch.tensor(bounds, device=device, dtype=torch.int32)
        inputs = case.make(b, t, h, d, device, seed=0, n_state=n)
        ro, rs, rg = _run_with_grads(case, inputs, cu, case.oracle, torch.float32)
        for variant, backend in _variants(name, case):
            shape = label if variant == name else f"{label} ({variant})"
            try:
                o, s, g = _run_with_grads(case, inputs, cu, backend, torch.bfloat16)
            except Exception as e:  # noqa: BLE001 (one failing backend, e.g. OutOfResources, must not hide the others)
                rows.append((shape, f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:100]}", float("nan"),
                             OUT_TOL))
                continue
            rows.append((shape, "o", error_ratio(o, ro), OUT_TOL))
            rows.append((shape, "final_state", error_ratio(s, rs), OUT_TOL))
            for gname, tol in case.grad_tol.items():
                if gname in g:
                    rows.append((shape, "d" + gname, error_ratio(g[gname], rg[gname]), tol))
    return rows


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
    x = _leaves(case.make(b, t, h, d, device, seed=0), torch.bfloat16)
    o, _ = case.call(x, None, backend)
    do = torch.randn_like(o)

    def fwd():
        return case.call(x, None, backend)

    def fwd_bwd():
        o, _ = case.call(x, None, backend)
        o.backward(do)

    return fwd, fwd_bwd, list(x.values())


def bench(ops, seqlens, tokens, heads, dim, device):
    import triton.testing

    rows = []
    for t in seqlens:
        b = max(tokens // t, 1)
        entries = [(label, (lambda op=op, backend=backend, b=b, t=t: _op_fn(CASES[op], b, t, heads, dim, device,
                                                                             backend)))
                   for op in ops for label, backend in _variants(op, CASES[op])]
        entries += [(f"sdpa_{kind}", (lambda kind=kind, b=b, t=t: _sdpa_fn(kind, b, t, heads, dim, device)))
                    for kind in ("flash", "cudnn")]
        for label, build in entries:
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
    runs = [(name, label, backend) for name in ops for label, backend in _variants(name, CASES[name])]
    for op, label, backend in runs:
        _, fwd_bwd_once, leaves = _op_fn(CASES[op], b, seqlen, heads, dim, device, backend)

        def fwd_bwd(step=fwd_bwd_once, leaves=leaves):
            # fresh gradients each call, as do_bench's grad_to_none: accumulating them would add an elementwise
            # kernel per input to every call (three of ~92 us each at 16K x 2 in session 16's profiles)
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
    p.add_argument("--append", action="store_true", help="append the tables to benchmarks/RESULTS.md")
    p.add_argument("--also-backends", nargs="+", default=[], metavar="BACKEND",
                   help="check and time these backends of every op too (e.g. torch), as rows OP_BACKEND")
    args = p.parse_args(argv)
    for name in args.ops:
        CASES[name] = dataclasses.replace(CASES[name], baselines={
            **CASES[name].baselines, **{f"{name}_{b}": b for b in args.also_backends if b != CASES[name].backend}})
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA GPU")
    device = "cuda"
    lines = []
    failed = False
    if not args.skip_check:
        lines += ["| op | case | quantity | error ratio | tolerance | ok |", "|---|---|---|---|---|---|"]
        print("\n".join(lines), flush=True)
        for op in args.ops:  # rows are printed as each op finishes, so a later crash or timeout keeps them
            for label, qty, err, tol in check(op, CASES[op], device):
                ok = err <= tol
                failed |= not ok
                lines.append(f"| {op} | {label} | {qty} | {err:.2e} | {tol:.0e} | {'yes' if ok else 'NO'} |")
                print(lines[-1], flush=True)
    global VALUE_DIM
    VALUE_DIM = args.dim_v
    if not args.skip_bench:
        table = ["| T | B | kernel | fwd ms | fwd+bwd ms |", "|---|---|---|---|---|"]
        print("\n" + "\n".join(table), flush=True)  # bench prints each row as it is measured
        rows = bench(args.ops, args.seqlens, args.tokens, args.heads, args.dim, device)
        table += [f"| {t} | {b} | {label} | {f:.3f} | {fb:.3f} |" for t, b, label, f, fb in rows]
        lines += [""] + table
    if args.profile:
        profile(args.ops, args.profile, args.tokens, args.heads, args.dim, device)
    if args.append:
        append_results("Kernels", "kernels.py", f"bf16, {args.tokens} tokens per call, H={args.heads}, D={args.dim}"
                       f"{'' if args.dim_v is None else f', V={args.dim_v} (SDPA: V=D)'}; medians of do_bench.", lines)
    return 1 if failed else 0


def append_results(title: str, script: str, detail: str, lines: list[str]) -> None:
    """Append a section to benchmarks/RESULTS.md: "## title, date, GPU (torch, triton)", the command that ran
    (benchmarks/script and this process's arguments), detail, then the table lines."""
    import triton

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = (f"\n## {title}, {stamp}, {torch.cuda.get_device_name()} (torch {torch.__version__}, triton "
            f"{triton.__version__})\n\n`python benchmarks/{script} {shlex.join(sys.argv[1:])}`\n\n{detail}\n\n")
    with open(REPO / "benchmarks" / "RESULTS.md", "a") as fh:
        fh.write(head + "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
