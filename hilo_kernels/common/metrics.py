"""The error ratio (docs/kernels.md) used by tests and benchmarks."""

import torch


def error_ratio(out: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS(out - ref) / RMS(ref), computed in float64 (0.0 when both are all zero)."""
    out = out.detach().to(torch.float64)
    ref = ref.detach().to(torch.float64)
    num = (out - ref).pow(2).mean().sqrt()
    den = ref.pow(2).mean().sqrt()
    if float(den) == 0.0:
        return float(num)
    return float(num / den)
