"""Short conv benchmark (hilo_kernels.short_conv): bf16 correctness of the Triton kernels against the fp32 naive oracle on
the GPU, then forward and forward+backward times of the Triton kernels and of ATen's conv1d path ("torch", what the
shells ran before) at the shells' widths, B*T = 32,768 tokens, K = 4, SiLU.

    python benchmarks/short_conv.py                      # C = 2304 (Mamba-2 340m's conv), 2048 (GDN's q / k / v)
    python benchmarks/short_conv.py --channels 4096 --seqlens 2048 16384

Times are medians of triton.testing.do_bench in ms.
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hilo_kernels.common import error_ratio
from hilo_kernels.short_conv import short_conv

TOL = {"y": 5e-3, "dx": 1e-2, "dweight": 1e-2, "dbias": 1e-2, "dstate": 1e-2}


def _inputs(b, t, c, k, dtype, state, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(b, t, c, device="cuda", generator=g).to(dtype)
    w = torch.randn(c, k, device="cuda", generator=g) * 0.5
    bias = torch.randn(c, device="cuda", generator=g)
    st = torch.randn(b, c, k - 1, device="cuda", generator=g).to(dtype) if state else None
    return x, w, bias, st


def _fwd_bwd(backend, x, w, bias, st, cu=None):
    leaves = [z.detach().requires_grad_() for z in (x, w, bias) + ((st,) if st is not None else ())]
    y = short_conv(leaves[0], leaves[1], leaves[2], initial_state=leaves[3] if st is not None else None,
                   cu_seqlens=cu, backend=backend)
    dy = torch.randn(y.shape, device=y.device, generator=torch.Generator(device=y.device).manual_seed(1))
    return [y, *torch.autograd.grad((y.float() * dy).sum(), leaves)]


def check(c: int) -> list[tuple]:
    rows = []
    for label, b, t, state, cu in (("B2 T777 state", 2, 777, True, None),
                                   ("varlen 1,15,700,333", 1, 1049, False,
                                    torch.tensor([0, 1, 16, 716, 1049], device="cuda"))):
        x, w, bias, st = _inputs(b, t, c, 4, torch.bfloat16, state)
        got = _fwd_bwd("triton", x, w, bias, st, cu)
        ref = _fwd_bwd("naive", x.float(), w, bias, None if st is None else st.float(), cu)
        names = ["y", "dx", "dweight", "dbias"] + (["dstate"] if state else [])
        for name, a, r in zip(names, got, ref, strict=True):
            err = error_ratio(a, r)
            rows.append((label, c, name, err, TOL[name], err <= TOL[name]))
    return rows


def bench(c: int, seqlens: list[int], tokens: int) -> list[tuple]:
    import triton

    rows = []
    for t in seqlens:
        b = max(tokens // t, 1)
        x, w, bias, _ = _inputs(b, t, c, 4, torch.bfloat16, False)
        for backend in ("triton", "torch"):
            leaves = tuple(z.detach().requires_grad_() for z in (x, w, bias))
            dy = torch.randn_like(x)
            fwd = triton.testing.do_bench(lambda leaves=leaves, backend=backend: short_conv(*leaves, backend=backend))

            def step(leaves=leaves, backend=backend, dy=dy):
                torch.autograd.grad(short_conv(*leaves, backend=backend), leaves, dy)

            rows.append((t, b, c, backend, fwd, triton.testing.do_bench(step)))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--channels", nargs="+", type=int, default=[2304, 2048])
    p.add_argument("--seqlens", nargs="+", type=int, default=[2048, 8192, 16384])
    p.add_argument("--tokens", type=int, default=32768)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/short_conv.py needs a CUDA GPU (the Triton kernels are checked on CPU by "
                         "tests/kernels/test_short_conv.py)")
    checks = [row for c in args.channels for row in check(c)]
    times = [row for c in args.channels for row in bench(c, args.seqlens, args.tokens)]
    lines = [(f"### Short conv, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
              f"{torch.cuda.get_device_name()}"), "",
             f"`python benchmarks/short_conv.py {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             "| case | C | tensor | error ratio (bf16 vs fp32 oracle) | tolerance | ok |", "|---|---|---|---|---|---|"]
    lines += [f"| {a} | {c} | {n} | {e:.2e} | {tol:.0e} | {'yes' if ok else 'NO'} |" for a, c, n, e, tol, ok in checks]
    lines += ["", "| T | B | C | backend | fwd ms | fwd+bwd ms |", "|---|---|---|---|---|---|"]
    lines += [f"| {t} | {b} | {c} | {be} | {f:.3f} | {fb:.3f} |" for t, b, c, be, f, fb in times]
    text = "\n".join(lines) + "\n"
    print(text)
    if not all(row[-1] for row in checks):
        raise SystemExit("short_conv: a bf16 check failed (see the table)")
    return checks, times


if __name__ == "__main__":
    main()
