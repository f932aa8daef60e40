"""Autocast's compute dtype, and one autocast copy of a layer input shared by the projections that read it."""

import torch
import torch.nn.functional as F

# The device types autocast exists for, read once at import: torch.amp.is_autocast_available is a builtin that
# dynamo (torch 2.11) cannot trace, so calling it in a compiled block broke its graph at every projection.
_AUTOCAST_DEVICES = frozenset(d for d in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla", "ipu", "maia")
                              if torch.amp.is_autocast_available(d))


def autocast_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype an op on autocast's lower-precision list (linear, conv1d) computes in for x: autocast's dtype where
    autocast is on for x's device (float64 is left alone), else x's dtype. For autograd.Functions that make
    autocast's casts themselves."""
    device = x.device.type
    if (device in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device) and x.is_floating_point()
            and x.dtype != torch.float64):
        return torch.get_autocast_dtype(device)
    return x.dtype


class _AliasCast(torch.autograd.Function):
    """x.to(cast.dtype) returned as a view of `cast` (x already cast, outside autograd): the same numbers and the
    same backward as a cast of its own (the gradient converted to x's dtype), but the aliases of one cast share its
    storage, so the projections' saved inputs are one tensor."""

    @staticmethod
    def forward(ctx, x, cast):
        ctx.dtype = x.dtype
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


class ProjectionInput:
    """The input x of several nn.Linear projections; calling it gives what to pass to the next one.

    Under autocast each projection casts x to the autocast dtype itself and keeps that copy for its backward: k
    projections of one x keep k copies. Here x is cast once and each call returns an alias of the copy with a cast
    node of its own, so the gradients still reach x one by one in x's dtype (summed in fp32, as before, and the
    same numbers) while one copy is kept. Without autocast (or when x needs no cast) a call returns x itself.
    """

    def __init__(self, x: torch.Tensor):
        self.x = x
        self.cast = None
        dtype = autocast_dtype(x)
        if dtype != x.dtype:
            with torch.no_grad():
                self.cast = x.to(dtype)

    def project(self, linears, fused: bool) -> list[torch.Tensor]:
        """Each of the bias-free nn.Linear `linears` applied to x: one by one, or with fused (config.
        fused_projections) as one matmul with their weights stacked, its output split back. The same products; x is
        read once, and the backward forms one input gradient instead of one per projection summed. The parameters
        stay the projections' own (checkpoints are unchanged); the outputs are then column slices of one tensor.
        Without autograd (evaluation, generate()) the projections run one by one: there is no input gradient to
        save, and stacking the weights again at every decoded token would copy them all once per token."""
        if not fused or len(linears) == 1 or not torch.is_grad_enabled():
            return [linear(self()) for linear in linears]
        sizes = [linear.out_features for linear in linears]
        # zero rows up to a multiple of 8 outputs: 16-byte rows in bf16, so the GEMM takes aligned kernels and a
        # slice that starts on a multiple of 8 columns (q, k, v, ...) can be read in place (hilo_kernels.short_conv)
        pad = -sum(sizes) % 8
        weights = [linear.weight for linear in linears]
        if pad:
            weights.append(weights[0].new_zeros(pad, weights[0].shape[1]))
            sizes.append(pad)
        return list(F.linear(self(), torch.cat(weights)).split(sizes, dim=-1))[:len(linears)]

    def __call__(self) -> torch.Tensor:
        if self.cast is None:
            return self.x
        if not (torch.is_grad_enabled() and self.x.requires_grad):
            return self.cast
        return _AliasCast.apply(self.x, self.cast)
