"""Depthwise causal short convolution (the short conv of the Mamba-2 and Gated DeltaNet shells)."""

import torch
import torch.nn.functional as F
from torch import nn

from models.casts import autocast_dtype


class _CausalConvFn(torch.autograd.Function):
    """act(conv1d(cat(state, x^T), weight, bias, groups=C))^T for x [B, T, C], state [B, C, K-1], act SiLU or none,
    keeping only x, state, weight and bias (in the conv's dtype) for the backward: the concatenated input and the
    pre-activation, which autograd would keep (two [B, C, K-1+T] copies), are rebuilt there. Autocast's casts are
    made by hand (those conv1d's autocast makes) and the backward calls the ops autograd's would
    (silu_backward, convolution_backward), so the outputs and gradients are the same numbers."""

    @staticmethod
    def forward(ctx, x, state, weight, bias, silu):
        ctx.dtypes = (x.dtype, state.dtype, weight.dtype, None if bias is None else bias.dtype)
        dtype = autocast_dtype(x)
        x, state, weight = x.to(dtype), state.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        # every operand in autocast's dtype already: autocast casts nothing
        y = F.conv1d(torch.cat((state, x.transpose(1, 2)), dim=2), weight, bias, groups=weight.shape[0])
        if silu:
            y = F.silu(y)
        ctx.save_for_backward(x, state, weight, bias)
        ctx.silu = silu
        return y.transpose(1, 2)

    @staticmethod
    def backward(ctx, dy):
        x, state, weight, bias = ctx.saved_tensors
        x_dtype, state_dtype, weight_dtype, bias_dtype = ctx.dtypes
        c, k = weight.shape[0], weight.shape[2]
        ext = torch.cat((state, x.transpose(1, 2)), dim=2)
        dpre = dy.transpose(1, 2).to(weight.dtype)
        if ctx.silu:
            dpre = torch.ops.aten.silu_backward(dpre, F.conv1d(ext, weight, bias, groups=c))
        need_ext = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        dext, dweight, dbias = torch.ops.aten.convolution_backward(
            dpre, ext, weight, None if bias is None else [c], [1], [0], [1], False, [0], c,
            [need_ext, ctx.needs_input_grad[2], bias is not None and ctx.needs_input_grad[3]])
        dx = dext[:, :, k - 1:].transpose(1, 2).to(x_dtype) if ctx.needs_input_grad[0] else None
        dstate = dext[:, :, :k - 1].to(state_dtype) if ctx.needs_input_grad[1] else None
        dweight = dweight.to(weight_dtype) if dweight is not None else None
        dbias = dbias.to(bias_dtype) if dbias is not None else None
        return dx, dstate, dweight, dbias, None


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
        else:
            # the last K-1 inputs of cat(state, x), from the last K-1 columns of x only (a new tensor: no view keeps
            # a prefill's whole input alive in the cache)
            tail = torch.cat((state.to(x.dtype), xt[:, :, max(0, t - (k - 1)):]), dim=2)
            new_state = tail[:, :, tail.shape[2] - (k - 1):].clone()
            if cu_seqlens is None:
                y = _CausalConvFn.apply(x, state, self.conv.weight, self.conv.bias, self.activation == "silu")
                return y, new_state
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
