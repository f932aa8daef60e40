"""What the launch heuristics need to know about the GPU."""

import functools

import torch

# An H200's count: the heuristics' answer off CUDA (the Triton interpreter), so CPU runs take the H200's launches.
DEFAULT_MULTIPROCESSORS = 132


@functools.cache
def _cuda_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (cached), DEFAULT_MULTIPROCESSORS off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT_MULTIPROCESSORS
    return _cuda_multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
