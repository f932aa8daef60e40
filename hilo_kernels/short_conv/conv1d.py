"""The short conv through ATen's depthwise conv1d (the CPU path; in x's dtype)."""

import torch
import torch.nn.functional as F

from .naive import positions_in_documents


class _CausalConvFn(torch.autograd.Function):
    """act(conv1d(cat(state, x^T), weight, bias, groups=C))^T for x [B, T, C], state [B, C, K-1], keeping only x,
    state, weight and bias (in x's dtype) for the backward: the concatenated input and the pre-activation, which
    autograd would keep (two [B, C, K-1+T] copies), are rebuilt there. The backward calls the ops autograd's would
    (silu_backward, convolution_backward), so the outputs and gradients are the same numbers."""

    @staticmethod
    def forward(ctx, x, state, weight, bias, silu):
        ctx.dtypes = (state.dtype, weight.dtype, None if bias is None else bias.dtype)
        dtype = x.dtype
        state, weight = state.to(dtype), weight.to(dtype).unsqueeze(1)  # conv1d's [C, 1, K]
        bias = None if bias is None else bias.to(dtype)
        y = F.conv1d(torch.cat((state, x.transpose(1, 2)), dim=2), weight, bias, groups=weight.shape[0])
        if silu:
            y = F.silu(y)
        ctx.save_for_backward(x, state, weight, bias)
        ctx.silu = silu
        return y.transpose(1, 2)

    @staticmethod
    def backward(ctx, dy):
        x, state, weight, bias = ctx.saved_tensors
        state_dtype, weight_dtype, bias_dtype = ctx.dtypes
        c, k = weight.shape[0], weight.shape[2]
        ext = torch.cat((state, x.transpose(1, 2)), dim=2)
        dpre = dy.transpose(1, 2).to(weight.dtype)
        if ctx.silu:
            dpre = torch.ops.aten.silu_backward(dpre, F.conv1d(ext, weight, bias, groups=c))
        need_ext = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        dext, dweight, dbias = torch.ops.aten.convolution_backward(
            dpre, ext, weight, None if bias is None else [c], [1], [0], [1], False, [0], c,
            [need_ext, ctx.needs_input_grad[2], bias is not None and ctx.needs_input_grad[3]])
        dx = dext[:, :, k - 1:].transpose(1, 2) if ctx.needs_input_grad[0] else None
        dstate = dext[:, :, :k - 1].to(state_dtype) if ctx.needs_input_grad[1] else None
        dweight = dweight[:, 0].to(weight_dtype) if dweight is not None else None
        dbias = dbias.to(bias_dtype) if dbias is not None else None
        return dx, dstate, dweight, dbias, None


def _packed(x, weight, bias, cu_seqlens, silu):
    """Packed documents: tap j (lag j) only where the token is at least j into its document."""
    t, k = x.shape[1], weight.shape[1]
    pos = positions_in_documents(t, cu_seqlens, x.device)
    w = weight.to(x.dtype)
    y = x * w[:, k - 1]
    for lag in range(1, min(k, t)):
        shifted = F.pad(x, (0, 0, lag, 0))[:, :t]
        y = y + shifted * (pos >= lag).unsqueeze(-1).to(x.dtype) * w[:, k - 1 - lag]
    if bias is not None:
        y = y + bias.to(x.dtype)
    return F.silu(y) if silu else y


def short_conv_conv1d(x, weight, bias, initial_state, cu_seqlens, silu):
    """Same contract as short_conv_naive, computed in x's dtype."""
    if cu_seqlens is not None:
        return _packed(x, weight, bias, cu_seqlens, silu)
    state = initial_state if initial_state is not None else x.new_zeros(x.shape[0], x.shape[2], weight.shape[1] - 1)
    return _CausalConvFn.apply(x, state, weight, bias, silu)
