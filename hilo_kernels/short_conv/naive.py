"""The short conv's definition, tap by tap in fp32 (the oracle)."""

import torch
import torch.nn.functional as F


def positions_in_documents(t: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """[T] int64: each token's position in its document (cu_seqlens), or its index when there are none."""
    pos = torch.arange(t, device=device)
    if cu_seqlens is None:
        return pos
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    return pos - torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=t)


def short_conv_naive(x, weight, bias, initial_state, cu_seqlens, silu):
    """y_t = act(bias + sum_j weight[:, K-1-j] x_{t-j}): x_{t-j} from x where t-j is in t's document, from
    initial_state where t-j < 0, else zero. Returns x's dtype."""
    b, t, c = x.shape
    k = weight.shape[1]
    ext = torch.zeros(b, k - 1 + t, c, device=x.device, dtype=torch.float32)
    ext[:, k - 1:] = x.float()
    if initial_state is not None:
        ext[:, : k - 1] = initial_state.float().transpose(1, 2)
    pos = positions_in_documents(t, cu_seqlens, x.device)
    y = torch.zeros(b, t, c, device=x.device, dtype=torch.float32)
    for lag in range(k):
        tap = ext[:, k - 1 - lag: k - 1 - lag + t]  # x_{t - lag}
        if cu_seqlens is not None:
            tap = tap * (pos >= lag)[None, :, None]
        y = y + weight[:, k - 1 - lag].float() * tap
    if bias is not None:
        y = y + bias.float()
    return (F.silu(y) if silu else y).to(x.dtype)
