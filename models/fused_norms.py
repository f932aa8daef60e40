"""Triton kernels (forward and backward) for the norms of models.norms: RMSNorm, residual-add + RMSNorm, and the
SiLU-gated, grouped RMSNorm.

One forward and one backward kernel, specialised by constexpr flags, compute, per row and per group of
group_size channels (the row's columns group*group_size ... (group+1)*group_size - 1):

    RMSNorm:                 y = x * rstd(x) * w
    residual + RMSNorm:      h = residual + x (rounded to h's dtype, as torch's add), y = h * rstd(h) * w
    gated, gate after norm:  u = x * SiLU(gate), y = u * rstd(u) * w               (Mamba-2)
    gated, gate before:      y = x * rstd(x) * w * SiLU(gate)                      (Gated DeltaNet, HLA)

with rstd(u) = 1 / sqrt(mean(u^2 over the group) + eps). Statistics and arithmetic are fp32 whatever the input
dtype (fp32, bf16 or fp16); y is stored in x's dtype (in h's, the promoted dtype of x and residual, for the
residual form), exactly as the torch modules return it. The backward kernel recomputes the normalized values
from the saved input and per-(row, group) rstd; each program walks a contiguous range of rows and writes its fp32
partial sum of the weight gradient to its own row of a [programs, dim] buffer that torch then sums (no atomics, no
host sync).

Entry points: rms_norm, add_rms_norm, gated_rms_norm (autograd-aware torch.library custom ops: one node each in a
compiled graph). use_triton says whether a call may take
them: CUDA tensors do, CPU tensors only under TRITON_INTERPRET=1 (set before import, as the kernels'
interpreter mode is fixed when they are decorated); fp64 inputs and groups wider than MAX_GROUP_SIZE keep the
torch code. models.norms dispatches to them when constructed with fused=True (config.fused_norms).
"""

import os

import torch
import triton
import triton.language as tl

from kernels.common.compile import dense_outputs
from kernels.common.gpu import multiprocessors

# Widest group the kernels take (a program holds a whole group in registers; the backward spills beyond this on
# sm_90); wider ones keep the torch code.
MAX_GROUP_SIZE = 8192
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def use_triton(group_size: int, *tensors: torch.Tensor) -> bool:
    """True when a norm over groups of group_size channels of these tensors may run the Triton kernels: group_size
    at most MAX_GROUP_SIZE, tensors non-empty, all fp32/bf16/fp16 and all on CUDA, or all on CPU under TRITON_INTERPRET=1."""
    if group_size > MAX_GROUP_SIZE or any(t.dtype not in _DTYPES or t.numel() == 0 for t in tensors):
        return False
    if all(t.is_cuda for t in tensors):
        return True
    return all(t.device.type == "cpu" for t in tensors) and os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _norm_fwd(
    X, R, G, W, Y, H, RSTD,
    stride_x, stride_r, stride_g, stride_y, stride_h,
    n_rows, group_size, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    group = tl.program_id(1)
    n_groups = tl.num_programs(1)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < group_size
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    c = (group * group_size + cols)[None, :]
    x = tl.load(X + rows64[:, None] * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + rows64[:, None] * stride_r + c, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(H.dtype.element_ty)
        tl.store(H + rows64[:, None] * stride_h + c, h, mask=mask)
        x = h.to(tl.float32)
    u = x
    if HAS_GATE:
        g = tl.load(G + rows64[:, None] * stride_g + c, mask=mask, other=0.0).to(tl.float32)
        silu = g * tl.sigmoid(g)
        if not NORM_BEFORE_GATE:
            u = x * silu
    rstd = tl.rsqrt(tl.sum(u * u, axis=1) / group_size + eps)
    tl.store(RSTD + rows64 * n_groups + group, rstd, mask=row_mask)
    w = tl.load(W + c, mask=col_mask[None, :], other=0.0).to(tl.float32)
    y = u * rstd[:, None] * w
    if HAS_GATE and NORM_BEFORE_GATE:
        y = y * silu
    tl.store(Y + rows64[:, None] * stride_y + c, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd(
    X, G, W, RSTD, DY, DH, DX, DR, DG, DW,
    stride_x, stride_g, stride_dy, stride_dh, stride_dx, stride_dr, stride_dg,
    n_rows, group_size, dim, rows_per_program,
    HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # X is the norm's input (h for the residual form). DH is the gradient flowing into h from outside the norm;
    # it is added to the norm's input gradient, which is both dx and dresidual.
    pid = tl.program_id(0)
    group = tl.program_id(1)
    n_groups = tl.num_programs(1)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < group_size
    c = (group * group_size + cols)[None, :]
    w = tl.load(W + c, mask=col_mask[None, :], other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for m0 in range(row_start, row_end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(X + rows64 * stride_x + c, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64 * stride_dy + c, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows.to(tl.int64) * n_groups + group, mask=row_mask, other=0.0)[:, None]
        u = x
        if HAS_GATE:
            g = tl.load(G + rows64 * stride_g + c, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(g)
            silu = g * sig
            dsilu = sig * (1.0 + g * (1.0 - sig))
            if not NORM_BEFORE_GATE:
                u = x * silu
        n = u * rstd
        if HAS_GATE and NORM_BEFORE_GATE:
            dg = dy * n * w * dsilu
            dy = dy * silu
        dw += tl.sum(dy * n, axis=0)
        a = dy * w
        # y = w * u * rstd(u)  =>  du = rstd * (a - n * mean(a * n)) per group, with a = dy * w
        du = rstd * (a - n * (tl.sum(a * n, axis=1) / group_size)[:, None])
        dx = du
        if HAS_GATE:
            if not NORM_BEFORE_GATE:
                dg = du * x * dsilu
                dx = du * silu
            tl.store(DG + rows64 * stride_dg + c, dg.to(DG.dtype.element_ty), mask=mask)
        if HAS_RESIDUAL:
            dx += tl.load(DH + rows64 * stride_dh + c, mask=mask, other=0.0).to(tl.float32)
            tl.store(DR + rows64 * stride_dr + c, dx.to(DR.dtype.element_ty), mask=mask)
        tl.store(DX + rows64 * stride_dx + c, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW + pid.to(tl.int64) * dim + c, dw[None, :], mask=col_mask[None, :])


def _tiles(group_size: int, elements: int, per_thread: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): whole groups of BLOCK_N >= group_size columns, about `elements` values a
    tile (several rows of narrow groups, one row of wide ones), about per_thread values of a tile a thread (the
    backward keeps about ten tiles live: 8 a thread stays under 255 registers without spills on sm_90)."""
    block_n = triton.next_power_of_2(group_size)
    block_m = max(1, min(elements // block_n, 64))
    num_warps = max(1, min(block_m * block_n // (32 * per_thread), 16))
    return block_m, block_n, num_warps


def _rows(t: torch.Tensor | None, dim: int) -> torch.Tensor | None:
    """[..., dim] -> [rows, dim] with unit column stride (a view when the layout allows: row stride is passed)."""
    if t is None:
        return None
    t = t.reshape(-1, dim)
    return t if t.stride(-1) == 1 else t.contiguous()


def _programs(n_tiles: int, n_groups: int, device: torch.device) -> int:
    """Backward programs along the rows: about 4 a streaming multiprocessor over all groups (each adds a row of
    dim fp32 partial weight gradients to sum), at most one a row tile; 4 under the interpreter."""
    if device.type != "cuda":
        return min(n_tiles, 4)
    return max(1, min(n_tiles, 4 * multiprocessors(device) // n_groups))


def _forward(x, residual, gate, weight, eps, group_size, norm_before_gate, y_dtype):
    dim = x.shape[-1]
    x2, r2, g2 = _rows(x, dim), _rows(residual, dim), _rows(gate, dim)
    n_rows, n_groups = x2.shape[0], dim // group_size
    y = torch.empty((n_rows, dim), dtype=y_dtype, device=x.device)
    h = torch.empty((n_rows, dim), dtype=y_dtype, device=x.device) if residual is not None else None
    rstd = torch.empty((n_rows, n_groups), dtype=torch.float32, device=x.device)
    block_m, block_n, num_warps = _tiles(group_size, 4096, 16)
    grid = (triton.cdiv(n_rows, block_m), n_groups)
    _norm_fwd[grid](
        x2, r2 if r2 is not None else x2, g2 if g2 is not None else x2, weight, y, h if h is not None else y, rstd,
        x2.stride(0), r2.stride(0) if r2 is not None else 0, g2.stride(0) if g2 is not None else 0, y.stride(0),
        h.stride(0) if h is not None else 0, n_rows, group_size, eps,
        HAS_RESIDUAL=residual is not None, HAS_GATE=gate is not None, NORM_BEFORE_GATE=norm_before_gate,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return y, h, rstd


def _backward(dy, dh, x2, g2, weight, rstd, group_size, norm_before_gate, x_dtype, r_dtype, g_dtype):
    n_rows, dim = x2.shape
    n_groups = dim // group_size
    dy2, dh2 = _rows(dy, dim), _rows(dh, dim)
    dx = torch.empty((n_rows, dim), dtype=x_dtype, device=x2.device)
    dr = torch.empty((n_rows, dim), dtype=r_dtype, device=x2.device) if dh is not None else None
    dg = torch.empty((n_rows, dim), dtype=g_dtype, device=x2.device) if g2 is not None else None
    block_m, block_n, num_warps = _tiles(group_size, 2048, 8)
    programs = _programs(triton.cdiv(n_rows, block_m), n_groups, x2.device)
    rows_per_program = block_m * triton.cdiv(triton.cdiv(n_rows, programs), block_m)
    programs = triton.cdiv(n_rows, rows_per_program)
    dw_partial = torch.empty((programs, dim), dtype=torch.float32, device=x2.device)
    _norm_bwd[(programs, n_groups)](
        x2, g2 if g2 is not None else x2, weight, rstd, dy2, dh2 if dh2 is not None else dy2, dx,
        dr if dr is not None else dx, dg if dg is not None else dx, dw_partial,
        x2.stride(0), g2.stride(0) if g2 is not None else 0, dy2.stride(0), dh2.stride(0) if dh2 is not None else 0,
        dx.stride(0), dr.stride(0) if dr is not None else 0, dg.stride(0) if dg is not None else 0,
        n_rows, group_size, dim, rows_per_program,
        HAS_RESIDUAL=dh is not None, HAS_GATE=g2 is not None, NORM_BEFORE_GATE=norm_before_gate,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return dx, dr, dg, dw_partial.sum(0).to(weight.dtype)


# Each norm is a torch.library custom op pair (hilo::<norm> and hilo::<norm>_backward), differentiable through
# register_autograd: eager calls run the kernels as they are, and torch.compile keeps each call as one node of the
# block's graph (its fake gives the output shapes) instead of tracing the host code (torch 2.11 traced
# models.norms' autograd.Functions into wrong gradients on CUDA; a custom op is never traced into).
def _y_fake(x, dtype):
    return x.new_empty(x.shape, dtype=dtype)


def _rstd_fake(x, group_size):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return x.new_empty(rows, x.shape[-1] // group_size, dtype=torch.float32)


@torch.library.custom_op("hilo::rms_norm", mutates_args=())
@dense_outputs
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y in x's dtype, rstd [rows, 1] fp32)."""
    y, _, rstd = _forward(x, None, None, weight, eps, x.shape[-1], False, x.dtype)
    return y.view(x.shape), rstd


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return _y_fake(x, x.dtype), _rstd_fake(x, x.shape[-1])


@torch.library.custom_op("hilo::rms_norm_backward", mutates_args=())
@dense_outputs
def _rms_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                          rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dx, _, _, dw = _backward(dy, None, _rows(x, x.shape[-1]), None, weight, rstd, x.shape[-1], False, x.dtype, None,
                             None)
    return dx.view(x.shape), dw


@_rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_grads(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_backward_op(dy, x, weight, rstd)
    return dx, dw, None


_rms_norm_op.register_autograd(_rms_norm_grads, setup_context=_rms_norm_setup)


@torch.library.custom_op("hilo::add_rms_norm", mutates_args=())
@dense_outputs
def _add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h = residual + x, both in the promoted dtype of x and residual; rstd [rows, 1] fp32)."""
    dtype = torch.promote_types(x.dtype, residual.dtype)
    y, h, rstd = _forward(x, residual, None, weight, eps, x.shape[-1], False, dtype)
    return y.view(x.shape), h.view(x.shape), rstd


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    dtype = torch.promote_types(x.dtype, residual.dtype)
    return _y_fake(x, dtype), _y_fake(x, dtype), _rstd_fake(x, x.shape[-1])


@torch.library.custom_op("hilo::add_rms_norm_backward", mutates_args=())
@dense_outputs
def _add_rms_norm_backward_op(dy: torch.Tensor, dh: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                              rstd: torch.Tensor, x_dtype: torch.dtype,
                              r_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dim = h.shape[-1]
    dx, dr, _, dw = _backward(dy, dh, _rows(h, dim), None, weight, rstd, dim, False, x_dtype, r_dtype, None)
    return dx.view(h.shape), dr.view(h.shape), dw


@_add_rms_norm_backward_op.register_fake
def _(dy, dh, h, weight, rstd, x_dtype, r_dtype):
    return h.new_empty(h.shape, dtype=x_dtype), h.new_empty(h.shape, dtype=r_dtype), weight.new_empty(weight.shape)


def _add_rms_norm_setup(ctx, inputs, output):
    x, residual, weight, _ = inputs
    _, h, rstd = output
    ctx.save_for_backward(h, weight, rstd)
    ctx.dtypes = (x.dtype, residual.dtype)


def _add_rms_norm_grads(ctx, dy, dh, _drstd):
    h, weight, rstd = ctx.saved_tensors
    dx, dr, dw = _add_rms_norm_backward_op(dy, dh, h, weight, rstd, *ctx.dtypes)
    return dx, dr, dw, None


_add_rms_norm_op.register_autograd(_add_rms_norm_grads, setup_context=_add_rms_norm_setup)


@torch.library.custom_op("hilo::gated_rms_norm", mutates_args=())
@dense_outputs
def _gated_rms_norm_op(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                       norm_before_gate: bool, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(y in x's dtype, rstd [rows, dim / group_size] fp32)."""
    y, _, rstd = _forward(x, None, gate, weight, eps, group_size, norm_before_gate, x.dtype)
    return y.view(x.shape), rstd


@_gated_rms_norm_op.register_fake
def _(x, gate, weight, eps, norm_before_gate, group_size):
    return _y_fake(x, x.dtype), _rstd_fake(x, group_size)


@torch.library.custom_op("hilo::gated_rms_norm_backward", mutates_args=())
@dense_outputs
def _gated_rms_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                                rstd: torch.Tensor, norm_before_gate: bool,
                                group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dim = x.shape[-1]
    dx, _, dg, dw = _backward(dy, None, _rows(x, dim), _rows(gate, dim), weight, rstd, group_size, norm_before_gate,
                              x.dtype, None, gate.dtype)
    return dx.view(x.shape), dg.view(x.shape), dw


@_gated_rms_norm_backward_op.register_fake
def _(dy, x, gate, weight, rstd, norm_before_gate, group_size):
    return x.new_empty(x.shape), gate.new_empty(gate.shape), weight.new_empty(weight.shape)


def _gated_rms_norm_setup(ctx, inputs, output):
    x, gate, weight, _, norm_before_gate, group_size = inputs
    ctx.save_for_backward(x, gate, weight, output[1])
    ctx.norm_before_gate, ctx.group_size = norm_before_gate, group_size


def _gated_rms_norm_grads(ctx, dy, _drstd):
    x, gate, weight, rstd = ctx.saved_tensors
    dx, dg, dw = _gated_rms_norm_backward_op(dy, x, gate, weight, rstd, ctx.norm_before_gate, ctx.group_size)
    return dx, dg, dw, None, None, None


_gated_rms_norm_op.register_autograd(_gated_rms_norm_grads, setup_context=_gated_rms_norm_setup)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] * rstd(x) * weight [dim] (fp32 statistics), in x's dtype. Gradients to x and weight."""
    return _rms_norm_op(x, weight, float(eps))[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(h), h) with h = residual + x ([..., dim] each, same shape), both in the promoted dtype of x and
    residual: the pre-norm block's "add the branch, normalize for the next branch" in one pass. Gradients to x,
    residual (from both outputs) and weight."""
    if x.shape != residual.shape:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
    y, h, _ = _add_rms_norm_op(x, residual, weight, float(eps))
    return y, h


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, norm_before_gate: bool,
                   group_size: int) -> torch.Tensor:
    """models.norms.GatedRMSNorm's function (x, gate [..., dim], weight [dim], group_size dividing dim), in x's
    dtype. Gradients to x, gate and weight."""
    return _gated_rms_norm_op(x, gate, weight, float(eps), bool(norm_before_gate), int(group_size))[0]
