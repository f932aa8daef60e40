"""models: the layer pieces of the recurrent shells: ShortConv (causal depthwise conv with a decode state and
packed documents) and GatedRMSNorm (hand-written backward), each against its definition written out here."""

import pytest
import torch
import torch.nn.functional as F

from models.conv import ShortConv
from models.norms import GatedRMSNorm


def conv_definition(x: torch.Tensor, weight: torch.Tensor, bias, starts: list[int]) -> torch.Tensor:
    """y_t = silu(bias + sum_{j<K} weight[:, K-1-j] x_{t-j}), taps before the token's document start are zero."""
    kk = weight.shape[-1]
    y = torch.zeros_like(x)
    for t in range(x.shape[1]):
        start = max(s for s in starts if s <= t)
        for lag in range(kk):
            if t - lag >= start:
                y[:, t] += weight[:, kk - 1 - lag] * x[:, t - lag]
    if bias is not None:
        y = y + bias
    return F.silu(y)


@pytest.mark.parametrize("kernel_size, bias", [(4, True), (3, False), (1, True)])
def test_short_conv_matches_definition_and_streams(kernel_size, bias):
    torch.manual_seed(0)
    conv = ShortConv(6, kernel_size, bias=bias).double()
    x = torch.randn(2, 11, 6, dtype=torch.float64)
    w = conv.conv.weight[:, 0, :].detach()
    b = None if conv.conv.bias is None else conv.conv.bias.detach()
    y, state = conv(x)
    torch.testing.assert_close(y, conv_definition(x, w, b, [0]))
    assert state.shape == (2, 6, kernel_size - 1)
    # streaming in pieces of 2, 1, 1, 7 tokens through the state gives the same outputs
    pieces, state = [], None
    for a, e in [(0, 2), (2, 3), (3, 4), (4, 11)]:
        out, state = conv(x[:, a:e], state)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, 1), y)


def test_short_conv_packed_documents_do_not_leak():
    torch.manual_seed(1)
    conv = ShortConv(5, 4, bias=True).double()
    x = torch.randn(1, 20, 5, dtype=torch.float64)
    cu = torch.tensor([0, 3, 4, 6, 20])
    y, _ = conv(x, cu_seqlens=cu)
    w, b = conv.conv.weight[:, 0, :].detach(), conv.conv.bias.detach()
    torch.testing.assert_close(y, conv_definition(x, w, b, cu[:-1].tolist()))
    with pytest.raises(ValueError, match="not both"):
        conv(x, state=torch.zeros(1, 5, 3, dtype=torch.float64), cu_seqlens=cu)


def gated_norm_definition(x, gate, weight, eps, norm_before_gate, group_size):
    u = x if norm_before_gate else x * torch.sigmoid(gate) * gate
    shaped = u.reshape(*u.shape[:-1], -1, group_size)
    y = (shaped / torch.sqrt((shaped * shaped).mean(-1, keepdim=True) + eps)).reshape(u.shape) * weight
    return y * torch.sigmoid(gate) * gate if norm_before_gate else y


@pytest.mark.parametrize("norm_before_gate, group_size", [(False, 12), (False, 4), (True, 12)])
def test_gated_rms_norm_forward_and_gradients(norm_before_gate, group_size):
    torch.manual_seed(2)
    norm = GatedRMSNorm(12, eps=1e-5, norm_before_gate=norm_before_gate, group_size=group_size).double()
    with torch.no_grad():
        norm.weight.add_(0.5 * torch.randn(12, dtype=torch.float64))
    x = torch.randn(3, 5, 12, dtype=torch.float64, requires_grad=True)
    gate = torch.randn(3, 5, 12, dtype=torch.float64, requires_grad=True)
    ref = gated_norm_definition(x, gate, norm.weight, 1e-5, norm_before_gate, group_size)
    torch.testing.assert_close(norm(x, gate), ref)
    assert torch.autograd.gradcheck(lambda a, g, w: GatedRMSNorm.forward(_with_weight(norm, w), a, g),
                                    (x, gate, norm.weight.detach().clone().requires_grad_()))


def _with_weight(norm: GatedRMSNorm, weight: torch.Tensor) -> GatedRMSNorm:
    clone = GatedRMSNorm(norm.weight.shape[0], norm.eps, norm.norm_before_gate, norm.group_size)
    del clone.weight
    clone.weight = weight
    return clone


def test_gated_rms_norm_bf16_keeps_dtype_and_tracks_fp32():
    torch.manual_seed(3)
    norm = GatedRMSNorm(64)
    x, gate = torch.randn(2, 7, 64), torch.randn(2, 7, 64)
    y = norm(x.bfloat16(), gate.bfloat16())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), norm(x, gate), atol=3e-2, rtol=2e-2)
