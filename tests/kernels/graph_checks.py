"""The chunked PyTorch paths' autograd graphs: one shared check for their tests."""

from collections import Counter

import torch


def backward_nodes(out: torch.Tensor) -> Counter:
    """How many nodes of each kind (SelectBackward0, ...) the backward graph of `out` holds."""
    seen, stack, counts = set(), [out.grad_fn], Counter()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        counts[type(node).__name__] += 1
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return counts


def assert_no_per_chunk_selects(run, short: int, long: int) -> None:
    """run(T) -> output of a chunked path at length T. Its chunk loop must not index a stacked tensor per chunk:
    each such index is a SelectBackward0 node that adds a zero gradient the size of the whole stack, quadratic in
    the chunk count (tiny Mamba-2 at 128 x 256 on CPU: 80 s a step, 15 s without). So the select count stays the same
    from `short` to `long` tokens."""
    few, many = (backward_nodes(run(t))["SelectBackward0"] for t in (short, long))
    assert few == many, f"{few} select nodes at T = {short}, {many} at T = {long}: per-chunk indexing in the loop"
