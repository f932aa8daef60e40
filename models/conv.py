"""Depthwise causal short convolution (the short conv of the Mamba-2 and Gated DeltaNet shells)."""

import torch
import torch.nn.functional as F
from torch import nn


class ShortConv(nn.Module):
    """y_t = act(bias + sum_{j=0}^{K-1} w[K-1-j] * x_{t-j}), per channel, causal, over x [B, T, C].

    Tokens before the start of the sequence are the K-1 columns of `state` ([B, C, K-1], the inputs that came
    before x; zeros when None). forward returns (y [B, T, C], new_state [B, C, K-1]): the last K-1 inputs of
    cat(state, x), which is the state to pass with the next tokens (decoding). With cu_seqlens [N+1] (B == 1,
    packed documents) no tap reaches across a document boundary: each document starts from zeros, as if it ran
    alone. activation is "silu" or None.
    """

    def __init__(self, channels: int, kernel_size: int = 4, bias: bool = False, activation: str | None = "silu"):
        super().__init__()
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
        if state is None:
            state = x.new_zeros(b, c, k - 1)
        elif state.shape != (b, c, k - 1):
            raise ValueError(f"ShortConv state must be [B, C, K-1] = {(b, c, k - 1)}, got {tuple(state.shape)}")
        xt = x.transpose(1, 2)
        ext = torch.cat((state.to(x.dtype), xt), dim=2)  # [B, C, K-1+T]
        # a copy, not a view: a view would keep the whole [B, C, K-1+T] input of a prefill alive in the cache
        new_state = ext[:, :, ext.shape[2] - (k - 1):].clone()
        if x.shape[1] == 1:
            # one decoding token: per channel, the dot product of its K inputs with its taps, as one matmul batched
            # over channels that adds the bias before its single rounding, as the conv does; conv1d's setup costs
            # several times this on the host
            taps = ext.transpose(0, 1)  # [C, B, K]
            weight = self.conv.weight.reshape(c, k, 1)
            if self.conv.bias is None:
                y = torch.bmm(taps, weight)
            else:
                y = torch.baddbmm(self.conv.bias.view(c, 1, 1), taps, weight)
            y = y.permute(1, 2, 0).contiguous()  # [B, 1, C]
        elif cu_seqlens is None:
            y = F.conv1d(ext, self.conv.weight, self.conv.bias, groups=c).transpose(1, 2)
        else:
            y = self._packed(x, cu_seqlens)
        if self.activation == "silu":
            y = F.silu(y)
        return y, new_state

    def _packed(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """The conv of packed documents: tap j (lag j) only where the token is at least j into its document."""
        if x.shape[0] != 1:
            raise ValueError(f"cu_seqlens needs packed inputs with batch size 1, got {x.shape[0]}")
        t = x.shape[1]
        cu = cu_seqlens.to(device=x.device, dtype=torch.long)
        starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=t)
        pos = torch.arange(t, device=x.device) - starts  # position of each token inside its document
        w = self.conv.weight[:, 0, :]  # [C, K]; w[:, K-1] multiplies the current token
        y = x * w[:, self.kernel_size - 1]
        for lag in range(1, min(self.kernel_size, t)):
            shifted = F.pad(x, (0, 0, lag, 0))[:, :t]
            keep = (pos >= lag).unsqueeze(-1).to(x.dtype)
            y = y + shifted * keep * w[:, self.kernel_size - 1 - lag]
        if self.conv.bias is not None:
            y = y + self.conv.bias
        return y

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 2 * K * C forward (a multiply-add per tap and channel), 3x for fwd + bwd."""
        return 6.0 * self.kernel_size * self.channels
