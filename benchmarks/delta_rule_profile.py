"""Per-kernel GPU times of kernels.delta_rule's Triton forward+backward (torch.profiler), bf16, H16, D128, at
T=1024 (B=32) and T=32768 (B=1): `python benchmarks/delta_rule_profile.py`. Imports only torch/triton/kernels."""
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernels import _leaves, _make_delta_rule
from kernels import delta_rule


def profile_shape(b: int, t: int, calls: int = 5) -> dict[str, float]:
    """Microseconds per forward+backward call for each Triton kernel of the op."""
    x = _leaves(_make_delta_rule(b, t, 16, 128, "cuda"), torch.bfloat16)

    def fwd_bwd():
        for leaf in x.values():
            leaf.grad = None
        o, _ = delta_rule(x["q"], x["k"], x["v"], x["beta"], x["g"])
        o.backward(torch.ones_like(o))

    fwd_bwd()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fwd_bwd()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.key.startswith("_") and e.key.endswith("_kernel"):
            out[e.key] = (getattr(e, "device_time_total", None) or e.cuda_time_total) / calls
    return out


if __name__ == "__main__":
    for b, t in [(32, 1024), (1, 32768)]:
        print(f"T={t} B={b} (us per fwd+bwd call)")
        for name, us in profile_shape(b, t).items():
            print(f"  {name:24s} {us:9.1f}")
