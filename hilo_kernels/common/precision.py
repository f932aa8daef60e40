"""Operators compute in the dtypes they document, whatever autocast region they are called from.

Under torch.autocast the chunked PyTorch paths would otherwise run their einsums and triangular solves in
bf16 (the delta rule's chunk path then misses its fp32 oracle by an error ratio of ~0.7) or fail on mixed
dtypes, and the Triton wrappers' torch pieces would change precision. The inputs keep the dtype the caller (or
autocast, in the projections before the call) gave them.
"""

import functools

import torch


def autocast_off(fn):
    """Run `fn` with autocast disabled on the device of its first tensor argument."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        if not torch.is_autocast_enabled(device):
            return fn(*args, **kwargs)
        with torch.autocast(device, enabled=False):
            return fn(*args, **kwargs)

    return wrapper
