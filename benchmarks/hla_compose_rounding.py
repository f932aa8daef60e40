"""What rounding HLA's intermediate to bf16 costs (HILO_HLA=compose16=1), in float64 on CPU.

    python benchmarks/hla_compose_rounding.py --seq-len 4096 [--heads 2 --dim 128]

hla2 / ahla as compositions of linear_attn passes (torch backend, float64), q and k L2-normalised, inputs rounded to
bf16, with and without a log-sigmoid decay. For each op: the error ratios of o and of dq, dk, dv against the exact
composition, (a) with the output and its gradient rounded to bf16 only, (b) with K~ / V~ and its gradient rounded
to bf16 between the passes as well, which is what compose16 adds. linear_attn's own bf16 kernels are not modelled
there; `--whole-bf16` adds a proxy for them: the whole composition through linear_attn's chunked PyTorch path in
bf16 (CPU bf16 matmuls, every intermediate in bf16), against float64, with the kernels.py check's decay.
"""

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # as a script, benchmarks/ comes first and benchmarks/kernels.py would shadow kernels
    sys.path.insert(0, str(REPO))

from kernels.common import error_ratio
from kernels.linear_attn import linear_attn


class _RoundBF16(torch.autograd.Function):
    """Round to bf16 going forward and the gradient to bf16 coming back (float64 in and out)."""

    @staticmethod
    def forward(ctx, x):
        return x.bfloat16().double()

    @staticmethod
    def backward(ctx, grad):
        return grad.bfloat16().double()


def _la(q, k, v, g, power):
    return linear_attn(q, k, v, None if g is None else power * g, scale=1.0, backend="torch")[0]


def compose(op: str, q, k, v, g, round_mid: bool):
    """hla2 "d1" or ahla through two float64 passes; round_mid rounds the intermediate as compose16 does."""
    if op == "hla2":
        mid = _la(q, k, k, g, 2)
        return _la(q, _RoundBF16.apply(mid) if round_mid else mid, v, g, 1)
    mid = _la(q, k, v, g, 1)
    return _la(q, k, _RoundBF16.apply(mid) if round_mid else mid, g, 1)


def measure(op: str, t: int, h: int, d: int, decay: bool, seed: int = 0) -> dict:
    """{"output only": [o, dq, dk, dv error ratios], "with the intermediate": [...]}."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(1, t, h, d, generator=gen, dtype=torch.float64), dim=-1)
            .bfloat16().double() for _ in range(2))
    v = torch.randn(1, t, h, d, generator=gen, dtype=torch.float64).bfloat16().double()
    g = torch.nn.functional.logsigmoid(torch.randn(1, t, h, generator=gen, dtype=torch.float64) + 4) / 8 if decay \
        else None
    do = torch.randn(1, t, h, d, generator=gen, dtype=torch.float64)

    def run(round_mid: bool, round_out: bool):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        o = compose(op, *xs, g, round_mid)
        if round_out:
            o = _RoundBF16.apply(o)
        return [o.detach(), *torch.autograd.grad((o * do).sum(), xs)]

    ref = run(False, False)
    return {name: [error_ratio(a, r) for a, r in zip(run(mid, True), ref, strict=True)]
            for name, mid in (("output only", False), ("with the intermediate", True))}


def measure_whole_bf16(op: str, t: int, h: int, d: int, seed: int = 0) -> list[float]:
    """[o, dq, dk, dv] error ratios of the composition run in bf16 by the chunked PyTorch path, against float64 on
    the same bf16 inputs (q, k L2-normalised; g = -0.3 U[0, 1) as benchmarks/kernels.py's check has it)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(1, t, h, d, generator=gen), dim=-1).bfloat16() for _ in range(2))
    v = torch.randn(1, t, h, d, generator=gen).bfloat16()
    g = -0.3 * torch.rand(1, t, h, generator=gen)
    do = torch.randn(1, t, h, d, generator=gen, dtype=torch.float64)
    runs = []
    for dtype in (torch.float64, torch.bfloat16):
        xs = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        o = compose(op, *xs, g.to(torch.promote_types(dtype, torch.float32)), False)
        runs.append([o.double(), *(x.double() for x in torch.autograd.grad((o.double() * do).sum(), xs))])
    return [error_ratio(a, r) for a, r in zip(runs[1], runs[0], strict=True)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--whole-bf16", action="store_true", help="also the whole composition in bf16 (a proxy)")
    args = ap.parse_args(argv)
    print("| T | decay | op | rounded | o | dq | dk | dv |\n|---|---|---|---|---|---|---|---|")
    for decay in (False, True):
        for op in ("hla2", "ahla"):
            for name, errs in measure(op, args.seq_len, args.heads, args.dim, decay).items():
                cells = " | ".join(f"{e:.2e}" for e in errs)
                decay_name = "log-sigmoid" if decay else "none"
                print(f"| {args.seq_len} | {decay_name} | {op} | {name} | {cells} |", flush=True)
    if args.whole_bf16:
        for op in ("hla2", "ahla"):
            cells = " | ".join(f"{e:.2e}" for e in measure_whole_bf16(op, args.seq_len, args.heads, args.dim))
            print(f"| {args.seq_len} | -0.3 U[0, 1) | {op} | whole composition in bf16 (torch path) | {cells} |",
                  flush=True)


if __name__ == "__main__":
    main()
