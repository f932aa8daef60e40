"""Depthwise causal short convolution (the short conv of the Mamba-2 and Gated DeltaNet shells): the module around
hilo_kernels.short_conv (parameters, decoding state, autocast) and its single-token decoding step."""

import torch
import torch.nn.functional as F
from torch import nn

from hilo_kernels.short_conv import short_conv
from models.casts import autocast_dtype


class ShortConv(nn.Module):
    """y_t = act(bias + sum_{j=0}^{K-1} w[K-1-j] * x_{t-j}), per channel, causal, over x [B, T, C].

    Tokens before the start of the sequence are the K-1 columns of `state` ([B, C, K-1], the inputs that came
    before x; zeros when None). forward returns (y [B, T, C], new_state [B, C, K-1]): the last K-1 inputs of
    cat(state, x), which is the state to pass with the next tokens (decoding). With cu_seqlens [N+1] (B == 1,
    packed documents) no tap reaches across a document boundary: each document starts from zeros, as if it ran
    alone, and new_state is [N, C, K-1], each document's own last K-1 inputs (zeros before its start: what a
    padded batch's prefill leaves for each row, models/padding.py). activation is "silu" or None. Sequences of several tokens go through hilo_kernels.short_conv (its Triton
    kernels on CUDA, ATen's conv1d elsewhere; `backend` picks one), in autocast's dtype where autocast is on.
    """

    def __init__(self, channels: int, kernel_size: int = 4, bias: bool = False, activation: str | None = "silu",
                 backend: str | None = None):
        super().__init__()
        self.backend = backend
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        if activation not in ("silu", None):
            raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
        self.channels = channels
        self.kernel_size = kernel_size
        self.activation = activation
        # nn.Conv1d owns the parameters (weight [C, 1, K], bias [C]) and their default init; forward calls
        # F.conv1d itself because the causal left context comes from the state, not from padding.
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        state: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, _, c = x.shape
        k = self.kernel_size
        if c != self.channels:
            raise ValueError(f"ShortConv expected {self.channels} channels, got x of shape {tuple(x.shape)}")
        if cu_seqlens is not None and state is not None:
            raise ValueError("ShortConv takes either cu_seqlens (packed documents) or a decoding state, not both")
        given_state = state
        if state is None:
            state = x.new_zeros(b, c, k - 1)
        elif state.shape != (b, c, k - 1):
            raise ValueError(f"ShortConv state must be [B, C, K-1] = {(b, c, k - 1)}, got {tuple(state.shape)}")
        t = x.shape[1]
        xt = x.transpose(1, 2)
        if t == 1:
            # one decoding token: per channel, the dot product of its K inputs with its taps, as one matmul batched
            # over channels that adds the bias before its single rounding, as the conv does; conv1d's setup costs
            # several times this on the host
            ext = torch.cat((state.to(x.dtype), xt), dim=2)  # [B, C, K]
            new_state = ext[:, :, 1:].clone()  # a copy: the cache must not keep the token's input alive
            taps = ext.transpose(0, 1)  # [C, B, K]
            weight = self.conv.weight.reshape(c, k, 1)
            if self.conv.bias is None:
                y = torch.bmm(taps, weight)
            else:
                y = torch.baddbmm(self.conv.bias.view(c, 1, 1), taps, weight)
            y = y.permute(1, 2, 0).contiguous()  # [B, 1, C]
            if self.activation == "silu":
                y = F.silu(y)
            return y, new_state
        if cu_seqlens is not None:
            new_state = document_tails(x[0], cu_seqlens, k - 1)
        else:
            # the last K-1 inputs of cat(state, x), from the last K-1 columns of x only (a new tensor: no view keeps
            # a prefill's whole input alive in the cache)
            tail = torch.cat((state.to(x.dtype), xt[:, :, max(0, t - (k - 1)):]), dim=2)
            new_state = tail[:, :, tail.shape[2] - (k - 1):].clone()
        y = short_conv(x.to(autocast_dtype(x)), self.conv.weight[:, 0, :], self.conv.bias, initial_state=given_state,
                       cu_seqlens=cu_seqlens, activation=self.activation, backend=self.backend)
        return y, new_state

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 2 * K * C forward (a multiply-add per tap and channel), 3x for fwd + bwd."""
        return 6.0 * self.kernel_size * self.channels


def document_tails(x: torch.Tensor, cu_seqlens: torch.Tensor, width: int) -> torch.Tensor:
    """[N, C, width]: the last `width` rows of each document of x [T, C] (packed by cu_seqlens [N+1]), zeros where a
    document is shorter: each document's conv state after it, as if it ran alone."""
    cu = cu_seqlens.to(device=x.device, dtype=torch.long)
    rows = cu[1:, None] - width + torch.arange(width, device=x.device)  # [N, width]
    inside = rows >= cu[:-1, None]
    tails = torch.where(inside[..., None], x[rows.clamp(min=0)], 0)  # [N, width, C]
    return tails.transpose(1, 2).contiguous()
