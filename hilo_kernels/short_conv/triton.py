"""Triton kernels of the short conv (forward and backward), token-major: x [B, T, C] is read where it lies, channels
contiguous, so no transpose or concatenation is made (ATen's conv1d wants [B, C, T] and a padded copy, and its
depthwise backward is slow at long T). Elementwise-bound: each program computes a [BT, BC] tile from its K shifted
input tiles; products and sums in fp32.

  forward        y = act(bias + sum_j w[:, K-1-j] x_{t-j})
  backward 1     (SiLU only) dpre = dy * silu'(pre), pre recomputed from x (nothing but x is kept)
  backward 2     dx_t = sum_j w[:, K-1-j] dpre_{t+j} (where token t+j's tap j reaches t: same document), and per tile
                 the partial sums of dw[:, K-1-j] = sum_t dpre_t x_{t-j} and dbias = sum_t dpre_t, added up in torch
                 (no atomics: the same sums every run)
The initial state's gradient (K-1 columns) is a few torch ops on dpre's first K-1 tokens.

The pair is a torch.library custom op ("hilo::short_conv"), differentiable through register_autograd, so
torch.compile keeps a block with a short conv as one graph (the op is one node) instead of breaking around it.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from hilo_kernels.common.compile import dense_outputs
from hilo_kernels.common.launch import current

from .naive import positions_in_documents

# Tiles [BT tokens, BC channels] and warps per program: hilo_kernels.common.launch's ShortConv table. H200, bf16,
# C = 2304, 16K x 2, fwd+bwd (each within the bf16 check): 32x64w4 1.234 ms, 64x64w4 0.908, 128x64w8 1.095, 64x128w8
# 1.488. So 64x64w4 without an initial state (the training path: 85-112 registers, no spills on sm_90, Triton 3.6),
# and 32x64w4 with one (64x64 spills 144-552 B there, 32x64 none). Addresses are one 64-bit scalar per program (the
# tile's first token) plus int32 offsets within the tile.
# The backward with SiLU: while torch.compile traces the call the kernels compute the linear conv and SiLU runs as
# torch ops after it (inductor fuses SiLU and its derivative into the elementwise kernels around the op, so the
# backward gets dpre in x's dtype from them and needs no dpre pass; the conv's output is rounded to x's dtype before
# the SiLU, one rounding more); in eager (where SiLU as torch ops would be two more passes) a dpre kernel writes
# dpre = dy * silu'(pre) in fp32 and the backward reads it. Compiled 340m training on the H200, paired runs: the
# graph form over the dpre kernel +1.4% / +2.4% for Gated DeltaNet at 8K, +1.2% / +2.2% for Mamba-2 at 16K. The
# silu_in_graph launch setting forces either form.


def tiles(has_state: bool) -> tuple[int, int, int]:
    """(BT, BC, warps) of the kernels' launches, without or with an initial state (hilo_kernels.common.launch)."""
    launch = current("short_conv")
    if has_state:
        return launch.state_block_t, launch.state_block_c, launch.state_warps
    return launch.block_t, launch.block_c, launch.warps


@triton.jit
def _tap(x_tile, SXT: tl.constexpr, state, pos, i_b, t0, rel, o_c, m_c, lag, T, C: tl.constexpr, K: tl.constexpr,
         HAS_STATE: tl.constexpr, VARLEN: tl.constexpr):
    """x_{t - lag} (fp32) at tokens t = t0 + rel of batch row i_b: from x inside t's document, from the state before
    the first token, else 0. x_tile points at token t0 of the row, whose tokens lie SXT elements apart (x's token
    stride, a constexpr as C is, so the taps' addresses fold as dense ones do); rel is a small int32 row offset."""
    rows = t0 + rel
    src = rows - lag
    m_t = rows < T
    if VARLEN:
        ok = m_t & (tl.load(pos + rows, mask=m_t, other=0) >= lag)
    else:
        ok = m_t & (src >= 0)
    val = tl.load(x_tile + (rel - lag)[:, None] * SXT + o_c[None, :], mask=ok[:, None] & m_c[None, :],
                  other=0.0).to(tl.float32)
    if HAS_STATE:
        m_s = m_t & (src < 0)
        val += tl.load(state + (i_b * C + o_c[None, :]) * (K - 1) + (K - 1 + src)[:, None],
                       mask=m_s[:, None] & m_c[None, :], other=0.0).to(tl.float32)
    return val


@triton.jit
def _pre(x_tile, SXT: tl.constexpr, w, bias, state, pos, i_b, t0, rel, o_c, m_c, T, C: tl.constexpr, K: tl.constexpr,
         BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr,
         VARLEN: tl.constexpr):
    """bias + sum_j w[:, K-1-j] x_{t-j} at tokens t = t0 + rel, fp32."""
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for lag in tl.static_range(K):
        wj = tl.load(w + o_c * K + (K - 1 - lag), mask=m_c, other=0.0).to(tl.float32)
        acc += wj[None, :] * _tap(x_tile, SXT, state, pos, i_b, t0, rel, o_c, m_c, lag, T, C, K, HAS_STATE, VARLEN)
    if HAS_BIAS:
        acc += tl.load(bias + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _tile_start(i_t, i_b, T, sxb, SXT: tl.constexpr, BT: tl.constexpr, C: tl.constexpr):
    """(t0, the tile's element offset in the dense [B, T, C] tensors and in x (strides sxb, SXT), as int64 scalars)."""
    t0 = i_t * BT
    return t0, (i_b * T + t0).to(tl.int64) * C, i_b.to(tl.int64) * sxb + t0.to(tl.int64) * SXT


@triton.jit(do_not_specialize=["T"])
def _short_conv_fwd(x, sxb, SXT: tl.constexpr, w, bias, state, pos, y, T, C: tl.constexpr, K: tl.constexpr,
                    BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr,
                    VARLEN: tl.constexpr, SILU: tl.constexpr):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, base, xbase = _tile_start(i_t, i_b, T, sxb, SXT, BT, C)
    rel = tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    acc = _pre(x + xbase, SXT, w, bias, state, pos, i_b, t0, rel, o_c, m_c, T, C, K, BT, BC, HAS_BIAS, HAS_STATE,
               VARLEN)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + base + rel[:, None] * C + o_c[None, :], acc.to(y.dtype.element_ty),
             mask=(t0 + rel < T)[:, None] & m_c[None, :])


@triton.jit
def _dpre_rows(x_tile, SXT: tl.constexpr, w, bias, state, pos, dy_tile, i_b, t0, rel, o_c, m_c, T, C: tl.constexpr,
               K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr,
               VARLEN: tl.constexpr, SILU: tl.constexpr):
    """dpre at tokens t0 + rel (0 past T): dy * silu'(pre) = dy * s (1 + pre (1 - s)), s = sigmoid(pre); dy
    without SiLU."""
    m = (t0 + rel < T)[:, None] & m_c[None, :]
    d = tl.load(dy_tile + rel[:, None] * C + o_c[None, :], mask=m, other=0.0).to(tl.float32)
    if SILU:
        pre = _pre(x_tile, SXT, w, bias, state, pos, i_b, t0, rel, o_c, m_c, T, C, K, BT, BC, HAS_BIAS, HAS_STATE,
                   VARLEN)
        s = tl.sigmoid(pre)
        d = d * s * (1.0 + pre * (1.0 - s))
    return d


@triton.jit(do_not_specialize=["T"])
def _short_conv_dpre(x, sxb, SXT: tl.constexpr, w, bias, state, pos, dy, dpre, T, C: tl.constexpr, K: tl.constexpr,
                     BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr,
                     VARLEN: tl.constexpr):
    """The backward's first pass with SiLU: dpre (fp32) of every token."""
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, base, xbase = _tile_start(i_t, i_b, T, sxb, SXT, BT, C)
    rel = tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    d = _dpre_rows(x + xbase, SXT, w, bias, state, pos, dy + base, i_b, t0, rel, o_c, m_c, T, C, K, BT, BC, HAS_BIAS,
                   HAS_STATE, VARLEN, True)
    tl.store(dpre + base + rel[:, None] * C + o_c[None, :], d, mask=(t0 + rel < T)[:, None] & m_c[None, :])


@triton.jit(do_not_specialize=["T", "NT"])
def _short_conv_bwd(x, sxb, SXT: tl.constexpr, w, bias, state, pos, dpre, dx, dw_part, db_part, T, NT, C: tl.constexpr,
                    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_STATE: tl.constexpr, VARLEN: tl.constexpr):
    """dx and this tile's parts of dw and dbias from dpre (the dpre kernel's, or dy without an activation)."""
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, base, xbase = _tile_start(i_t, i_b, T, sxb, SXT, BT, C)
    rel = tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    m_t = t0 + rel < T
    x_tile = x + xbase
    # dx_t: every later token t + lag whose tap lag reads x_t (inside the same document)
    d_own = _dpre_rows(x_tile, SXT, w, bias, state, pos, dpre + base, i_b, t0, rel, o_c, m_c, T, C, K, BT, BC,
                       HAS_BIAS, HAS_STATE, VARLEN, False)
    acc = tl.load(w + o_c * K + (K - 1), mask=m_c, other=0.0).to(tl.float32)[None, :] * d_own
    for lag in tl.static_range(1, K):
        d = _dpre_rows(x_tile, SXT, w, bias, state, pos, dpre + base, i_b, t0, rel + lag, o_c, m_c, T, C, K, BT, BC,
                       HAS_BIAS, HAS_STATE, VARLEN, False)
        if VARLEN:
            tt = t0 + rel + lag
            ok = tt < T
            d = tl.where((ok & (tl.load(pos + tt, mask=ok, other=0) >= lag))[:, None], d, 0.0)
        acc += tl.load(w + o_c * K + (K - 1 - lag), mask=m_c, other=0.0).to(tl.float32)[None, :] * d
    tl.store(dx + base + rel[:, None] * C + o_c[None, :], acc.to(dx.dtype.element_ty),
             mask=m_t[:, None] & m_c[None, :])
    # this tile's parts of dw and dbias
    part = (i_b * NT + i_t).to(tl.int64)
    for lag in tl.static_range(K):
        tap = _tap(x_tile, SXT, state, pos, i_b, t0, rel, o_c, m_c, lag, T, C, K, HAS_STATE, VARLEN)
        tl.store(dw_part + (part * K + (K - 1 - lag)) * C + o_c, tl.sum(d_own * tap, 0), mask=m_c)
    tl.store(db_part + part * C + o_c, tl.sum(d_own, 0), mask=m_c)


def _channels_dense(x: torch.Tensor) -> torch.Tensor:
    """x itself when its channels are contiguous and its rows start on 16-byte boundaries (the kernels take its batch
    and token strides, and their loads stay vectorized), else a dense copy: a misaligned row stride (a slice of a
    [.., 4614]-column bf16 projection output, say) would make every load of the four taps a scalar one."""
    size = x.element_size()
    aligned = x.data_ptr() % 16 == 0 and all(x.stride(i) * size % 16 == 0 for i in (0, 1))
    return x if x.stride(2) == 1 and aligned else x.contiguous()


def _flags(weight, bias, state, pos):
    return {"K": weight.shape[1], "HAS_STATE": state is not None and weight.shape[1] > 1, "VARLEN": pos is not None}


@torch.library.custom_op("hilo::short_conv", mutates_args=())
@dense_outputs
def _short_conv_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],  # noqa: UP045 (schema)
                   state: Optional[torch.Tensor], pos: Optional[torch.Tensor], silu: bool) -> torch.Tensor:  # noqa: UP045
    b, t, c = x.shape
    # x is read through its batch and token strides (a column slice of a wider projection output needs no copy);
    # the other tensors are made dense (a compiled graph may hand the op other strides than eager code does)
    x, weight = _channels_dense(x), weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    state = None if state is None else state.contiguous()
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    flags = _flags(weight, bias, state, pos)
    bt, bc, warps = tiles(flags["HAS_STATE"])
    if t:
        _short_conv_fwd[(triton.cdiv(t, bt), triton.cdiv(c, bc), b)](
            x, x.stride(0), x.stride(1), weight, bias if bias is not None else weight,
            state if state is not None else x, pos if pos is not None else x, y, t, C=c, BT=bt, BC=bc,
            HAS_BIAS=bias is not None, SILU=silu, **flags, num_warps=warps)
    return y


@_short_conv_op.register_fake
def _(x, weight, bias, state, pos, silu):
    return x.new_empty(x.shape)


@torch.library.custom_op("hilo::short_conv_backward", mutates_args=())
@dense_outputs
def _short_conv_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                            bias: Optional[torch.Tensor], state: Optional[torch.Tensor],  # noqa: UP045
                            pos: Optional[torch.Tensor], silu: bool  # noqa: UP045
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias, dstate); dbias is zeros [C] without a bias, dstate empty without a state."""
    b, t, c = x.shape
    k = weight.shape[1]
    x, weight = _channels_dense(x), weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    state = None if state is None else state.contiguous()
    flags = _flags(weight, bias, state, pos)
    bt, bc, warps = tiles(flags["HAS_STATE"])
    grid = (triton.cdiv(t, bt), triton.cdiv(c, bc), b)
    state_arg, pos_arg = (state if state is not None else x), (pos if pos is not None else x)
    dy = dy.contiguous()
    if silu and t:
        dpre = torch.empty(b, t, c, device=x.device, dtype=torch.float32)
        _short_conv_dpre[grid](x, x.stride(0), x.stride(1), weight, bias if bias is not None else weight, state_arg,
                               pos_arg, dy, dpre, t, C=c, BT=bt, BC=bc, HAS_BIAS=bias is not None, **flags,
                               num_warps=warps)
    else:
        dpre = dy  # no activation (or no tokens): dpre is dy
    nt = triton.cdiv(t, bt)
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    dw_part = torch.zeros(b * nt, k, c, device=x.device, dtype=torch.float32)
    db_part = torch.zeros(b * nt, c, device=x.device, dtype=torch.float32)
    if t:
        _short_conv_bwd[grid](x, x.stride(0), x.stride(1), weight, bias if bias is not None else weight, state_arg,
                              pos_arg, dpre, dx, dw_part, db_part, t, nt, C=c, BT=bt, BC=bc, HAS_BIAS=bias is not None,
                              **flags, num_warps=warps)
    dweight = dw_part.sum(0).t().contiguous().to(weight.dtype)
    dbias = db_part.sum(0).to(bias.dtype if bias is not None else torch.float32)
    if state is None:
        return dx, dweight, dbias, x.new_empty(0)
    # state column i is input position i - (K-1): tap lag of token i - (K-1) + lag reads it
    dstate = torch.zeros(b, c, k - 1, device=x.device, dtype=torch.float32)
    w = weight.float()
    for i in range(k - 1):
        for lag in range(k):
            tok = i - (k - 1) + lag
            if 0 <= tok < t:
                dstate[:, :, i] += w[:, k - 1 - lag] * dpre[:, tok].float()
    return dx, dweight, dbias, dstate.to(state.dtype)


@_short_conv_backward_op.register_fake
def _(dy, x, weight, bias, state, pos, silu):
    c = x.shape[2]
    dstate = x.new_empty(0) if state is None else state.new_empty(state.shape)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), x.new_empty(c, dtype=bias.dtype if bias is not None
                                                                      else torch.float32), dstate


def _setup_context(ctx, inputs, output):
    x, weight, bias, state, pos, silu = inputs
    ctx.save_for_backward(x, weight, bias, state, pos)
    ctx.silu = silu


def _backward(ctx, dy):
    x, weight, bias, state, pos = ctx.saved_tensors
    dx, dweight, dbias, dstate = _short_conv_backward_op(dy, x, weight, bias, state, pos, ctx.silu)
    return dx, dweight, (dbias if bias is not None else None), (dstate if state is not None else None), None, None


_short_conv_op.register_autograd(_backward, setup_context=_setup_context)


def short_conv_triton(x, weight, bias, initial_state, cu_seqlens, silu):
    """Same contract as short_conv_naive; y in x's dtype."""
    pos = None
    if cu_seqlens is not None:
        pos = positions_in_documents(x.shape[1], cu_seqlens, x.device).to(torch.int32)
    state = None if initial_state is None else initial_state.contiguous()
    forced = current("short_conv").silu_in_graph
    in_graph = silu and (torch.compiler.is_compiling() if forced is None else forced)
    y = _short_conv_op(x, weight.contiguous(), None if bias is None else bias.contiguous(), state, pos,
                       silu and not in_graph)
    return torch.nn.functional.silu(y) if in_graph else y
