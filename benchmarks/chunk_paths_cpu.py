"""Forward+backward time of the chunked PyTorch paths (backend="torch", the CPU path) of the recurrent operators.

    python benchmarks/chunk_paths_cpu.py                       # 2 x 4096, H = 4, K = V = 64, fp32
    python benchmarks/chunk_paths_cpu.py --batch 8 --seq-len 1024 --ops linear_attn

Random inputs (q, v normal; k unit-norm rows; g in [-0.1, 0]; beta in [0, 1]; level scales in [0.25, 1.25]); the
best of --repeats runs of each op's forward and the backward of its output's sum. Imports only torch and kernels.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch

from kernels import delta_rule, linear_attn, loglinear_attn
from kernels.loglinear_attn import num_levels

OPS = ("linear_attn", "delta_rule", "loglinear_attn")


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    for name in ("batch", "seq_len", "heads", "dim", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    torch.manual_seed(0)
    b, t, h, d = args.batch, args.seq_len, args.heads, args.dim

    def leaf(x):
        return x.requires_grad_()

    q, v = leaf(torch.randn(b, t, h, d)), leaf(torch.randn(b, t, h, d))
    k = leaf(torch.nn.functional.normalize(torch.randn(b, t, h, d), dim=-1))
    g, beta = leaf(-torch.rand(b, t, h) * 0.1), leaf(torch.rand(b, t, h))
    lam = leaf(torch.rand(b, t, h, num_levels(t)) + 0.25)
    calls = {"linear_attn": lambda: linear_attn(q, k, v, g, backend="torch")[0],
             "delta_rule": lambda: delta_rule(q, k, v, beta, g, backend="torch")[0],
             "loglinear_attn": lambda: loglinear_attn(q, k, v, g, lam, backend="torch")[0]}
    best = {}
    for name in args.ops:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            calls[name]().sum().backward()
            times.append(time.perf_counter() - start)
        best[name] = min(times)
        print(f"{name}: {best[name]:.3f} s fwd+bwd at {b} x {t}, H = {h}, K = V = {d} (best of {args.repeats})")
    return best


if __name__ == "__main__":
    main()
