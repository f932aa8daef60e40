"""Triton kernels of the chunked second-order algorithm (docs/kernels.md; backend "fused" of hla2, and of ahla).

Per head, chunks of BT = 64 tokens, q^ = scale * q, l the in-chunk inclusive cumsum of g, l_C its last value,
Gamma^(p)_ij = exp(p (l_i - l_j)) [j <= i], and (a, b) = (p_in, p_out) = (2, 1) for hla2 decay "d1", (1, 2) for
"d2", (1, 1) for ahla. hla2 carries S (K x K) and F (K x V) from chunk to chunk:

    K~ = e^{a l} Q^ S_in + (Gamma^(a) * Q^ K^T) K          S_out = e^{a l_C} S_in + K^T diag(e^{a (l_C - l)}) K
    O  = e^{b l} Q^ F_in + (Gamma^(b) * Q^ K~^T) V         F_out = e^{b l_C} F_in + K~^T diag(e^{b (l_C - l)}) V

(ahla likewise with P (K x V), E (K x V): V~ from (K, V, P), then O from (K, V~, E)). Never W W^T (C^3). The
states are fp32 and every exponent is <= 0. Forward, four launches:
  1. `_state_scan`: the inner state entering every chunk (S_in; sequential per (document, head, K-, V-block)),
  2. `_chunk_out`: K~ (or V~) for all chunks in parallel, fp32,
  3. `_state_scan`: the outer state entering every chunk (F_in),
  4. `_chunk_out`: O for all chunks in parallel.
Backward, the same in reverse (dF carried backwards, then dS), each pass's gradients in two chunk-parallel
kernels (`_pass_dvalues` per (V-block, chunk, head); `_pass_dqk` per (K-block, chunk, head), looping over V):
  1. `_state_scan` reversed with (Q^, dO): dF_out of every chunk, and d F_0,
  2. `_pass_dvalues`, `_pass_dqk` of the outer pass: dv, dK~ (fp32) and its parts of dq and of the gate gradient,
  3. `_state_scan` reversed with (Q^, dK~): dS_out of every chunk, and d S_0,
  4. `_pass_dvalues`, `_pass_dqk` of the inner pass: k's gradient as value (written first), then dq and dk as
     key with the outer pass's partials and the value part added (ahla: the inner pass's dq, dk, dv likewise).
Gate gradient: pass p decays by exp(p (G_t - G_s)), G the in-document cumsum of g, so
dL/dG_t = b (q^_t.dq^outer_t - x_t.dx_t) + a (q^_t.dq^inner_t - k_t.dk^key_t) (x the outer pass's keys), plus
b <F_T, dF_T> + a <S_T, dS_T> at a document's last token; dg_t = sum_{s >= t in its document} dL/dG_s (as in
linear_attn's backward).

Why this split rather than one sequential kernel carrying S and F together: computing K~ inside the sequential
loop puts a (C x K) @ (K x K) product on every chunk's critical path, and the backward would have to hold dS and
the whole dF in one program (dK~ sums over all value columns); here the scans do one small product per chunk and
the heavy products run chunk-parallel. The cost is the per-chunk states in memory (fp32: K~ and the states grow
with t, and bf16 copies would use up most of the bf16 error budget). Dots run on fp32 operands ("ieee" for fp32
inputs, tf32 for fp16/bf16). Chunk tables come from hilo_kernels.common.varlen (no host sync) and T is not
specialised on, so a new T never recompiles. Every kernel loops over or grids K and V in blocks (of <= 128 by
default), so any head dim up to 256 works.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from hilo_kernels.common.compile import dense_outputs, grad_or_zeros, unused_grads_stay_none
from hilo_kernels.common.launch import current, hla_cols
from hilo_kernels.linear_attn.triton_bwd import _segment_reverse_cumsum
from hilo_kernels.linear_attn.triton_fwd import BT, Layout, _chunk_bounds, _pow2, _seq_bounds

from .state import STATE_TYPES, decay_powers, split_normalized, with_ones

# Launch settings (warps, stages, tiles of each kernel family: the scans, the chunk outputs, the value gradients, the
# query / key gradients): hilo_kernels.common.launch's HLA table and its head-size rule (hla_cols). On the H200 (bf16
# fwd+bwd) the chunk kernels at 4 warps with 128-wide K loops took hla2 7.57 ms against 10.50 (8 warps, 64-wide) at
# 16K x 2, H = 16, D = 128, ahla 7.07 against 11.08, hla2 at hla_mamba2's heads (8K x 4, H = 32, K = 128, V = 64)
# 12.18 against 17.20; a 128-register cap, 3 stages, wider output tiles or a 64-wide dqk V loop on top of that were
# slower, and the scans' settings did not pay. _pass_dqk's K loop 64 wide (at 128 it spilled 744-848 B a thread,
# AOT): hla2 7.10 ms against 7.52, at hla_mamba2's heads 11.38 against 12.14. Measured and deleted: bf16 or scaled
# fp16 dot operands (hla2 fwd+bwd 12.3 ms against 10.5 with fp16; these kernels are not bound by their dot rate),
# fp16 chunk states or inner outputs with power-of-two scales (8.88 and 13.47 ms against 7.52: the scale passes cost
# more than the bytes they save), and persistent chunk programs.


def _launch_kwargs(family: str) -> dict:
    """num_warps, num_stages and (when capped) maxnreg of one kernel family's launches."""
    launch = current("hla")
    out = {"num_warps": getattr(launch, family + "_warps"), "num_stages": getattr(launch, family + "_stages")}
    if getattr(launch, family + "_maxnreg"):
        out["maxnreg"] = getattr(launch, family + "_maxnreg")
    return out


def _precision(q: torch.Tensor) -> str:
    """The dots' precision for inputs of q's dtype (fp32 intermediates such as K~ do not change it): "ieee" for fp32,
    "tf32" (products of fp32 tiles) for 16-bit inputs."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """a @ b of fp32 operands at input_precision PREC, accumulated in fp32."""
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _load_state(hs, base, o_row, o_col, mask, DY: tl.constexpr):
    """The fp32 tile of a per-chunk state at rows o_row (its DX index) and columns o_col (its DY index), any
    broadcastable pair of index tiles (a transposed tile passes them transposed); base: the (chunk, head) offset in
    elements of the state (DX * DY per chunk and head)."""
    return tl.load(hs + base + o_row * DY + o_col, mask=mask, other=0.0)


@triton.jit(do_not_specialize=["T", "NT"])
def _state_scan(x, y, g, h0, hs, ht, bounds, offsets, x_scale, T, NT,
                H: tl.constexpr, DX: tl.constexpr, DY: tl.constexpr, BT: tl.constexpr, BX: tl.constexpr,
                BY: tl.constexpr, POWER: tl.constexpr, REVERSE: tl.constexpr, HAS_G: tl.constexpr,
                HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    """Forward: hs[c] = state entering chunk c, state <- e^{p l_C} state + (x e^{p (l_C - l)})^T y.
    REVERSE: hs[c] = gradient of the state leaving chunk c, state <- e^{p l_C} state + (x_scale x e^{p l})^T y.
    x [TT, H, DX], y [TT, H, DY]; h0 / ht [N, H, DX, DY] (initial and last value), hs [rows, H, DX, DY] fp32."""
    i_xy, i_nh = tl.program_id(0), tl.program_id(1)
    NY: tl.constexpr = triton.cdiv(DY, BY)
    i_x, i_y = i_xy // NY, i_xy % NY
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, c0 = _seq_bounds(bounds, offsets, i_n, T, NT, IS_VARLEN)
    o_x = i_x * BX + tl.arange(0, BX)
    o_y = i_y * BY + tl.arange(0, BY)
    m_xy = (o_x[:, None] < DX) & (o_y[None, :] < DY)
    xy_off = o_x[:, None] * DY + o_y[None, :]
    state = tl.zeros([BX, BY], dtype=tl.float32)
    if HAS_H0:
        state += tl.load(h0 + i_nh.to(tl.int64) * DX * DY + xy_off, mask=m_xy, other=0.0).to(tl.float32)
    nchunks = tl.cdiv(eos - bos, BT)
    for it in range(nchunks):
        if REVERSE:
            c = nchunks - 1 - it
        else:
            c = it
        tl.store(hs + ((c0 + c) * H + i_h) * DX * DY + xy_off, state, mask=m_xy)
        o_t = bos + c * BT + tl.arange(0, BT)
        m_t = o_t < eos
        xb = _load_tok(x, o_t[:, None], i_h, o_x[None, :], m_t[:, None] & (o_x[None, :] < DX), H, DX).to(tl.float32)
        yb = _load_tok(y, o_t[:, None], i_h, o_y[None, :], m_t[:, None] & (o_y[None, :] < DY), H, DY).to(tl.float32)
        if HAS_G:
            gb = tl.load(g + o_t * H + i_h, mask=m_t, other=0.0).to(tl.float32) * POWER
            gc = tl.cumsum(gb, 0)
            gl = tl.sum(gb, 0)
            state *= tl.exp(gl)
            if REVERSE:
                xb = xb * (tl.exp(gc) * x_scale)[:, None]
            else:
                xb = xb * tl.exp(gl - gc)[:, None]
        else:
            xb = xb * x_scale
        state += _dot(tl.trans(xb), yb, PREC)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * DX * DY + xy_off, state, mask=m_xy)


@triton.jit
def _load_tok(ptr, o_row, i_h, o_col, mask, H: tl.constexpr, D: tl.constexpr):
    """A tile of a token tensor [TT, H, D] at tokens o_row and columns o_col (broadcastable index tiles, either
    orientation)."""
    return tl.load(ptr + (o_row * H + i_h) * D + o_col, mask=mask, other=0.0)


@triton.jit(do_not_specialize=["T", "NT"])
def _chunk_out(q, x, y, g, hs, o, table, scale, T, NT,
               H: tl.constexpr, K: tl.constexpr, DY: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               BY: tl.constexpr, POWER: tl.constexpr, HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr,
               PREC: tl.constexpr):
    """o = scale (e^{p l} (q hs_in) + (Gamma^(p) * q x^T) y) for one (DY-block, chunk, head): q, x [TT, H, K],
    y [TT, H, DY], hs [rows, H, K, DY] (the state entering each chunk)."""
    i_y, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = _chunk_bounds(table, i_c, T, NT, BT, IS_VARLEN)
    if start < end:
        _chunk_out_tile(q, x, y, g, hs, o, scale, i_y, i_c, i_h, start, end, H, K, DY, BT, BK, BY, POWER, HAS_G,
                        PREC)


@triton.jit
def _chunk_out_tile(q, x, y, g, hs, o, scale, i_y, i_c, i_h, start, end,
                    H: tl.constexpr, K: tl.constexpr, DY: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                    BY: tl.constexpr, POWER: tl.constexpr, HAS_G: tl.constexpr, PREC: tl.constexpr):
    """_chunk_out's work for chunk i_c = tokens [start, end)."""
    o_t = start + tl.arange(0, BT)
    m_t = o_t < end
    o_y = i_y * BY + tl.arange(0, BY)
    acc = tl.zeros([BT, BY], dtype=tl.float32)
    scores = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k[None, :] < K)
        qb = tl.load(q + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        xb = _load_tok(x, o_t[:, None], i_h, o_k[None, :], m_tk, H, K).to(tl.float32)
        hb = _load_state(hs, (i_c.to(tl.int64) * H + i_h) * K * DY, o_k[:, None], o_y[None, :],
                         (o_k[:, None] < K) & (o_y[None, :] < DY), DY)
        acc += _dot(qb, hb, PREC)
        scores += _dot(qb, tl.trans(xb), PREC)
    o_i = tl.arange(0, BT)
    causal = o_i[:, None] >= o_i[None, :]
    if HAS_G:
        gc = tl.cumsum(tl.load(g + o_t * H + i_h, mask=m_t, other=0.0).to(tl.float32) * POWER, 0)
        acc *= tl.exp(gc)[:, None]
        scores *= tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
    scores = tl.where(causal, scores, 0.0)
    yb = _load_tok(y, o_t[:, None], i_h, o_y[None, :], m_t[:, None] & (o_y[None, :] < DY), H, DY).to(tl.float32)
    acc += _dot(scores, yb, PREC)
    acc *= scale
    tl.store(o + (o_t[:, None] * H + i_h) * DY + o_y[None, :], acc.to(o.dtype.element_ty),
             mask=m_t[:, None] & (o_y[None, :] < DY))


@triton.jit(do_not_specialize=["T", "NT"])
def _pass_dvalues(q, x, do, g, dhs, dy, table, scale, T, NT,
                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, POWER: tl.constexpr, HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr,
                  PREC: tl.constexpr):
    """dY of one pass O = LA(Q^, X, Y; p g) for one (V-block, chunk, head), given dO and dS_out (the gradient of
    the state leaving each chunk, dhs [rows, H, K, V] fp32):  dy = e^{p (l_C - l)} (X dS_out) + (Gamma * Q^ X^T)^T dO.
    q, x [TT, H, K], do, dy [TT, H, V]."""
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = _chunk_bounds(table, i_c, T, NT, BT, IS_VARLEN)
    if start < end:
        _pass_dvalues_tile(q, x, do, g, dhs, dy, scale, i_v, i_c, i_h, start, end, H, K, V, BT, BK, BV, POWER, HAS_G,
                           PREC)


@triton.jit
def _pass_dvalues_tile(q, x, do, g, dhs, dy, scale, i_v, i_c, i_h, start, end,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, POWER: tl.constexpr, HAS_G: tl.constexpr, PREC: tl.constexpr):
    """_pass_dvalues' work for chunk i_c = tokens [start, end)."""
    o_t = start + tl.arange(0, BT)
    m_t = o_t < end
    o_v = i_v * BV + tl.arange(0, BV)
    m_tv = m_t[:, None] & (o_v[None, :] < V)
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    scores_t = tl.zeros([BT, BT], dtype=tl.float32)  # [j, i] = x_j . q^_i
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k[None, :] < K)
        xb = _load_tok(x, o_t[:, None], i_h, o_k[None, :], m_tk, H, K).to(tl.float32)
        q_t = tl.load(q + (o_t[None, :] * H + i_h) * K + o_k[:, None], mask=m_tk.T, other=0.0).to(tl.float32)
        dsb = _load_state(dhs, (i_c.to(tl.int64) * H + i_h) * K * V, o_k[:, None], o_v[None, :],
                          (o_k[:, None] < K) & (o_v[None, :] < V), V)
        acc += _dot(xb, dsb, PREC)
        scores_t += _dot(xb, q_t, PREC)
    o_i = tl.arange(0, BT)
    anti = o_i[:, None] <= o_i[None, :]  # j <= i in the [j, i] layout
    if HAS_G:
        gb = tl.load(g + o_t * H + i_h, mask=m_t, other=0.0).to(tl.float32) * POWER
        gc = tl.cumsum(gb, 0)
        acc *= tl.exp(tl.sum(gb, 0) - gc)[:, None]
        scores_t *= tl.exp(tl.where(anti, gc[None, :] - gc[:, None], float("-inf")))
    scores_t = tl.where(anti, scores_t * scale, 0.0)
    dob = tl.load(do + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
    acc += _dot(scores_t, dob, PREC)
    tl.store(dy + (o_t[:, None] * H + i_h) * V + o_v[None, :], acc.to(dy.dtype.element_ty), mask=m_tv)


@triton.jit(do_not_specialize=["T", "NT", "TT"])
def _pass_dqk(q, x, y, g, do, hs, dhs, dq_prev, dx_prev, dq, dx, r_parts, table,
              scale, T, NT, TT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
              BK: tl.constexpr, BV: tl.constexpr, POWER: tl.constexpr, HAS_G: tl.constexpr, HAS_PREV: tl.constexpr,
              IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    """dq, dX (X as keys) and the gate partial p (q^.dq^ - x.dx) of one pass O = LA(Q^, X, Y; p g) for one
    (K-block, chunk, head), given dO; with HAS_PREV, dq_prev and dx_prev are added (a later pass's partials, or
    X's gradient from its other role). With dA = Gamma * (dO Y^T):
        dq^ = e^{p l} (dO S_in^T) + dA X,     dx = e^{p (l_C - l)} (Y dS_out^T) + dA^T Q^.
    hs / dhs [rows, H, K, V] fp32: the state entering and the gradient of the state leaving each chunk; the gate
    partial of K-block i goes to r_parts[i] [TT, H]."""
    i_k, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = _chunk_bounds(table, i_c, T, NT, BT, IS_VARLEN)
    if start >= end:
        return
    o_t = start + tl.arange(0, BT)
    m_t = o_t < end
    o_k = i_k * BK + tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k[None, :] < K)
    tok_k = (o_t[:, None] * H + i_h) * K + o_k[None, :]
    state_base = (i_c.to(tl.int64) * H + i_h) * K * V
    d_scores = tl.zeros([BT, BT], dtype=tl.float32)
    acc_q = tl.zeros([BT, BK], dtype=tl.float32)
    acc_x = tl.zeros([BT, BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v[None, :] < V)
        dob = tl.load(do + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        yb = _load_tok(y, o_t[:, None], i_h, o_v[None, :], m_tv, H, V).to(tl.float32)
        y_t = _load_tok(y, o_t[None, :], i_h, o_v[:, None], m_tv.T, H, V).to(tl.float32)
        # states as [BV, BK] tiles (transposed addressing)
        m_vk = (o_v[:, None] < V) & (o_k[None, :] < K)
        sb_t = _load_state(hs, state_base, o_k[None, :], o_v[:, None], m_vk, V)
        dsb_t = _load_state(dhs, state_base, o_k[None, :], o_v[:, None], m_vk, V)
        d_scores += _dot(dob, y_t, PREC)
        acc_q += _dot(dob, sb_t, PREC)
        acc_x += _dot(yb, dsb_t, PREC)
    o_i = tl.arange(0, BT)
    causal = o_i[:, None] >= o_i[None, :]
    if HAS_G:
        gb = tl.load(g + o_t * H + i_h, mask=m_t, other=0.0).to(tl.float32) * POWER
        gc = tl.cumsum(gb, 0)
        acc_q *= tl.exp(gc)[:, None]
        acc_x *= tl.exp(tl.sum(gb, 0) - gc)[:, None]
        d_scores *= tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
    d_scores = tl.where(causal, d_scores, 0.0)
    xb = _load_tok(x, o_t[:, None], i_h, o_k[None, :], m_tk, H, K).to(tl.float32)
    acc_q += _dot(d_scores, xb, PREC)
    qh = tl.load(q + tok_k, mask=m_tk, other=0.0).to(tl.float32) * scale
    acc_x += _dot(tl.trans(d_scores), qh, PREC)
    if HAS_G:
        r = tl.sum(qh * acc_q - xb * acc_x, 1) * POWER
        tl.store(r_parts + i_k.to(tl.int64) * TT * H + o_t * H + i_h, r, mask=m_t)
    acc_q *= scale
    if HAS_PREV:
        acc_q += tl.load(dq_prev + tok_k, mask=m_tk, other=0.0)
        acc_x += tl.load(dx_prev + tok_k, mask=m_tk, other=0.0)
    tl.store(dq + tok_k, acc_q.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dx + tok_k, acc_x.to(dx.dtype.element_ty), mask=m_tk)


def _scan_blocks(dx: int, dy: int, programs: int) -> tuple[int, int]:
    """Tiles of the sequential scans: 64 x 64, or 64 x 32 when that leaves the GPU under-filled (the scan_by launch
    setting sets the columns)."""
    bx, by = _pow2(dx, hi=64), _pow2(dy, hi=64)
    chosen = current("hla").scan_by
    if chosen:
        return bx, _pow2(dy, hi=chosen)
    if programs * triton.cdiv(dx, bx) * triton.cdiv(dy, by) < 256 and by > 32:
        by = 32
    return bx, by


def _scan(x, y, g, power, h0, lay: Layout, reverse: bool, x_scale: float, store_last: bool, prec: str):
    """Per-chunk states [rows, H, DX, DY] fp32 and the last state [N, H, DX, DY] fp32 (or None)."""
    dx, dy = x.shape[-1], y.shape[-1]
    h = lay.heads
    bx, by = _scan_blocks(dx, dy, lay.n * h)
    hs = torch.empty(lay.rows, h, dx, dy, device=x.device, dtype=torch.float32)
    ht = torch.empty(lay.n, h, dx, dy, device=x.device, dtype=torch.float32) if store_last else None
    grid = (triton.cdiv(dx, bx) * triton.cdiv(dy, by), lay.n * h)
    _state_scan[grid](x, y, g if g is not None else x, h0 if h0 is not None else hs, hs,
                      ht if ht is not None else hs, lay.bounds, lay.offsets, x_scale, lay.seqlen, lay.nt, H=h, DX=dx,
                      DY=dy, BT=BT, BX=bx, BY=by, POWER=power, REVERSE=reverse, HAS_G=g is not None,
                      HAS_H0=h0 is not None, STORE_HT=store_last, IS_VARLEN=lay.varlen, PREC=prec,
                      **_launch_kwargs("scan"))
    return hs, ht


def _out(q, x, y, g, power, hs, scale, lay: Layout, out_dtype, prec):
    """The chunk outputs of one pass [TT, H, DY] in out_dtype."""
    dk, dy = q.shape[-1], y.shape[-1]
    by = _pow2(dy, hi=hla_cols(dk).out_by)
    o = torch.empty(*y.shape, device=y.device, dtype=out_dtype)
    grid = (triton.cdiv(dy, by), lay.rows, lay.heads)
    _chunk_out[grid](q, x, y, g if g is not None else q, hs, o, lay.table, scale, lay.seqlen, lay.nt, H=lay.heads,
                     K=dk, DY=dy, BT=BT, BK=_pow2(dk, hi=current("hla").out_bk), BY=by, POWER=power,
                     HAS_G=g is not None, IS_VARLEN=lay.varlen, PREC=prec, **_launch_kwargs("out"))
    return o


def _pass_grads(q, x, y, g, do, hs, dhs, power, scale, lay: Layout, dtypes, prev=None, dy=None):
    """(dq, dx, dy, gate partial or None) of one pass O = LA(Q^, X, Y; p g), in dtypes (dq, dx, dy); prev: the
    (dq, dx, gate partial) to add (a later pass's, or X's gradient from its other role); dy: a buffer for dY."""
    dk, dv = q.shape[-1], y.shape[-1]
    h = lay.heads
    gate = g if g is not None else q
    launch = current("hla")
    prec = _precision(q)
    dy = torch.empty(y.shape, device=q.device, dtype=dtypes[2]) if dy is None else dy
    bk, bv = _pow2(dk, hi=launch.dvalues_bk), _pow2(dv, hi=hla_cols(dk).dvalues_bv)
    _pass_dvalues[(triton.cdiv(dv, bv), lay.rows, h)](
        q, x, do, gate, dhs, dy, lay.table, scale, lay.seqlen, lay.nt, H=h, K=dk, V=dv, BT=BT, BK=bk, BV=bv,
        POWER=power, HAS_G=g is not None, IS_VARLEN=lay.varlen, PREC=prec, **_launch_kwargs("dvalues"))
    dq, dx = (torch.empty(t.shape, device=q.device, dtype=d) for t, d in zip((q, x), dtypes[:2], strict=True))
    bk = _pow2(dk, hi=launch.dqk_bk)
    bv = _pow2(dv, hi=launch.dqk_bv) if launch.dqk_bv else 32  # 32 by default even at V = 16
    nk = triton.cdiv(dk, bk)
    r_parts = torch.empty(nk, lay.total, h, device=q.device, dtype=torch.float32) if g is not None else None
    dq_prev, dx_prev, r_prev = prev if prev is not None else (dq, dx, None)
    _pass_dqk[(nk, lay.rows, h)](q, x, y, gate, do, hs, dhs, dq_prev, dx_prev, dq, dx,
                                 r_parts if r_parts is not None else dq, lay.table, scale, lay.seqlen, lay.nt,
                                 lay.total, H=h, K=dk, V=dv, BT=BT, BK=bk, BV=bv, POWER=power, HAS_G=g is not None,
                                 HAS_PREV=prev is not None, IS_VARLEN=lay.varlen, PREC=prec,
                                 **_launch_kwargs("dqk"))
    r = None
    if g is not None:
        r = r_parts.sum(0) if r_prev is None else r_parts.sum(0) + r_prev
    return dq, dx, dy, r


def _final_state_gate_terms(r, finals, d_finals, powers, lay: Layout):
    """Add p <X_T, dX_T> of every final state X at its document's last token (the final states decay as
    exp(p G) from every source token), to the gate partial r [TT, H]."""
    term = None
    for x, dx, p in zip(finals, d_finals, powers, strict=True):
        if dx is not None:
            t = p * (x * dx).sum((-2, -1))
            term = t if term is None else term + t
    if term is None:
        return r
    if lay.varlen:
        last = (lay.bounds[1:] - 1).clamp(min=0)
        term = term * (lay.bounds[1:] > lay.bounds[:-1])[:, None]
    else:
        last = torch.arange(1, lay.n + 1, device=r.device) * lay.seqlen - 1
    return r.index_add(0, last, term)


def fused_fwd(op, q, k, v, g, scale, powers, h0, lay: Layout, store_final: bool, out_dtype):
    """q, k [TT, H, K], v [TT, H, V] contiguous, g [TT, H] fp32 or None, h0 (inner, outer) initial states or
    (None, None) -> (o [TT, H, V] in out_dtype, (inner, outer) final states (fp32 or None), saved), saved =
    (the inner pass's output K~ or V~ fp32, the inner and outer per-chunk states fp32), for the backward.
    hla2: K~ = LA(Q^, K, K; a g), O = LA(Q^, K~, V; b g);  ahla: V~ = LA(Q^, K, V; g), O = LA(Q^, K, V~; g)."""
    p_in, p_out = powers
    prec = _precision(q)
    inner_value = k if op == "hla2" else v
    in_states, in_last = _scan(k, inner_value, g, p_in, h0[0], lay, False, 1.0, store_final, prec)
    mid = _out(q, k, inner_value, g, p_in, in_states, scale, lay, torch.float32, prec)
    outer_key, outer_value = (mid, v) if op == "hla2" else (k, mid)  # K~ is the outer pass's key, V~ its value
    out_states, out_last = _scan(outer_key, outer_value, g, p_out, h0[1], lay, False, 1.0, store_final, prec)
    o = _out(q, outer_key, outer_value, g, p_out, out_states, scale, lay, out_dtype, prec)
    return o, (in_last, out_last), (mid, in_states, out_states)


def fused_bwd(op, q, k, v, g, saved, finals, do, d_finals, scale, powers, lay: Layout, need_h0: bool):
    """Gradients (dq, dk, dv, dg or None, (d inner, d outer) initial states or None) on the packed layout."""
    p_in, p_out = powers
    mid, in_states, out_states = saved
    prec = _precision(q)
    d_out_states, d_out_h0 = _scan(q, do, g, p_out, d_finals[1], lay, True, scale, need_h0, prec)
    f32 = torch.float32
    if op == "hla2":
        # outer pass: keys K~, values V;  then the inner pass K~ = LA(Q^, K, K), whose k is key and value: its
        # value gradient (written first) is added to its key gradient
        dq_outer, dmid, dv, r = _pass_grads(q, mid, v, g, do, out_states, d_out_states, p_out, scale, lay,
                                            (f32, f32, v.dtype))
        d_in_states, d_in_h0 = _scan(q, dmid, g, p_in, d_finals[0], lay, True, scale, need_h0, prec)
        dk_as_value = torch.empty(k.shape, device=k.device, dtype=f32)
        dq, dk, _, r_all = _pass_grads(q, k, k, g, dmid, in_states, d_in_states, p_in, scale, lay,
                                       (q.dtype, k.dtype, f32), prev=(dq_outer, dk_as_value, r), dy=dk_as_value)
    else:
        # outer pass: keys K, values V~;  then the inner pass V~ = LA(Q^, K, V), adding the outer partials
        dq_outer, dk_outer, dmid, r = _pass_grads(q, k, mid, g, do, out_states, d_out_states, p_out, scale, lay,
                                                  (f32, f32, f32))
        d_in_states, d_in_h0 = _scan(q, dmid, g, p_in, d_finals[0], lay, True, scale, need_h0, prec)
        dq, dk, dv, r_all = _pass_grads(q, k, v, g, dmid, in_states, d_in_states, p_in, scale, lay,
                                        (q.dtype, k.dtype, v.dtype), prev=(dq_outer, dk_outer, r))
    dg = None
    if g is not None:
        dg = _segment_reverse_cumsum(_final_state_gate_terms(r_all, finals, d_finals, powers, lay), lay)
    return dq, dk, dv, dg, (d_in_h0, d_out_h0)


def _flat(q, k, v, g, cu_seqlens=None):
    """q, k, v [B, T, H, D] and g [B, T, H] on the packed token axis (contiguous; g in fp32), and their Layout."""
    b, t, h, _ = q.shape
    qf, kf, vf = (x.reshape(b * t, h, x.shape[-1]).contiguous() for x in (q, k, v))
    gf = None if g is None else g.reshape(b * t, h).contiguous().float()
    return qf, kf, vf, gf, Layout(b, t, h, cu_seqlens, q.device)


class FusedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, h0_inner, h0_outer, cu_seqlens, op, scale, powers, output_final_state,
                out_dtype):
        b, t, h, dk = q.shape
        dv = v.shape[-1]
        qf, kf, vf, gf, lay = _flat(q, k, v, g, cu_seqlens)
        h0 = tuple(None if x is None else x.contiguous().float() for x in (h0_inner, h0_outer))
        o, finals, saved = fused_fwd(op, qf, kf, vf, gf, scale, powers, h0, lay, output_final_state, out_dtype)
        ctx.save_for_backward(qf, kf, vf, gf, *saved, *finals)
        ctx.lay, ctx.op, ctx.scale, ctx.powers, ctx.shape = lay, op, scale, powers, (b, t, h, dk, dv)
        ctx.h0_dtypes = tuple(None if x is None else x.dtype for x in (h0_inner, h0_outer))
        ctx.g_dtype = None if g is None else g.dtype
        return o.reshape(b, t, h, dv), *finals

    @staticmethod
    def backward(ctx, do, d_final_inner, d_final_outer):
        qf, kf, vf, gf, *rest = ctx.saved_tensors
        saved, finals = rest[:3], rest[3:]
        b, t, h, dk, dv = ctx.shape
        do = do.reshape(b * t, h, dv).contiguous()
        d_finals = tuple(None if x is None else x.contiguous().float() for x in (d_final_inner, d_final_outer))
        dq, dk_, dv_, dg, dh0 = fused_bwd(ctx.op, qf, kf, vf, gf, saved, finals, do, d_finals, ctx.scale,
                                          ctx.powers, ctx.lay, need_h0=ctx.h0_dtypes[0] is not None)
        dg = None if dg is None else dg.reshape(b, t, h).to(ctx.g_dtype)
        dh0 = tuple(None if x is None else x.to(d) for x, d in zip(dh0, ctx.h0_dtypes, strict=True))
        return (dq.reshape(b, t, h, dk), dk_.reshape(b, t, h, dk), dv_.reshape(b, t, h, dv), dg, *dh0,
                None, None, None, None, None, None)


# Fixed-length calls without an initial or a final state (what training makes) are also a torch.library custom op
# pair: a compiled graph holds the operator as one node instead of breaking around it. The forward returns what the
# backward needs (the inner pass's output K~ or V~ and both passes' chunk states) as outputs of its
# own, so the backward recomputes nothing; their shapes follow from the inputs' (rows = B * ceil(T / BT) chunk rows).
@torch.library.custom_op("hilo::hla_fused", mutates_args=())
@dense_outputs
def _hla_fused_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],  # noqa: UP045
                  op: str, scale: float, p_in: int, p_out: int, out_fp32: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o [B, T, H, V] in v's dtype, or fp32 with out_fp32; the inner output K~ [B*T, H, K] (hla2) or V~ [B*T, H, V]
    (ahla) fp32; the inner chunk states [rows, H, K, K or V] and the outer ones [rows, H, K, V] fp32)."""
    qf, kf, vf, gf, lay = _flat(q, k, v, g)
    o, _, saved = fused_fwd(op, qf, kf, vf, gf, scale, (p_in, p_out), (None, None), lay, False,
                            torch.float32 if out_fp32 else v.dtype)
    return o.reshape(v.shape), *saved


@_hla_fused_op.register_fake
def _(q, k, v, g, op, scale, p_in, p_out, out_fp32):
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    rows = b * triton.cdiv(t, BT)
    inner = dk if op == "hla2" else dv
    f32 = torch.float32
    return (v.new_empty(v.shape, dtype=f32 if out_fp32 else v.dtype), q.new_empty(b * t, h, inner, dtype=f32),
            q.new_empty(rows, h, dk, inner, dtype=f32), q.new_empty(rows, h, dk, dv, dtype=f32))


@torch.library.custom_op("hilo::hla_fused_backward", mutates_args=())
@dense_outputs
def _hla_fused_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           g: Optional[torch.Tensor], mid: torch.Tensor, in_states: torch.Tensor,  # noqa: UP045
                           out_states: torch.Tensor, op: str, scale: float, p_in: int, p_out: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv in their inputs' dtypes, dg in g's dtype (empty without g))."""
    qf, kf, vf, gf, lay = _flat(q, k, v, g)
    b, t, h, _ = q.shape
    dof = do.reshape(b * t, h, do.shape[-1]).contiguous()
    dq, dk, dv, dg, _ = fused_bwd(op, qf, kf, vf, gf, (mid, in_states, out_states), (None, None), dof, (None, None), scale, (p_in, p_out), lay,
                                  need_h0=False)
    dg = q.new_empty(0, dtype=torch.float32) if g is None else dg.reshape(g.shape).to(g.dtype)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), dg


@_hla_fused_backward_op.register_fake
def _(do, q, k, v, g, mid, in_states, out_states, op, scale, p_in, p_out):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(0, dtype=torch.float32) if g is None else g.new_empty(g.shape))


def _hla_fused_setup(ctx, inputs, output):
    q, k, v, g, op, scale, p_in, p_out, _ = inputs
    ctx.save_for_backward(q, k, v, g, *output[1:])
    ctx.args = (op, scale, p_in, p_out)
    unused_grads_stay_none(ctx, output)


def _hla_fused_grads(ctx, do, *_d_saved):
    q, k, v, g, *saved = ctx.saved_tensors
    do = grad_or_zeros(ctx, do)
    dq, dk, dv, dg = _hla_fused_backward_op(do, q, k, v, g, *saved, *ctx.args)
    return dq, dk, dv, (dg if g is not None else None), None, None, None, None, None


_hla_fused_op.register_autograd(_hla_fused_grads, setup_context=_hla_fused_setup)


def hla_fused(op, q, k, v, g, decay, normalize, eps, scale, initial_state, output_final_state, cu_seqlens):
    """Backend "fused" of hilo_kernels.hla2 and hilo_kernels.ahla (same contract); inputs already validated. Returns
    (o in q's dtype, HLA2State / AHLAState or None). normalize=True appends a ones column to v (the
    denominator rides through both passes) and divides at the end. Fixed-length calls without states take the
    custom op pair (hilo::hla_fused), the rest the autograd.Function: the same kernels."""
    powers = decay_powers(op, decay)
    vv = with_ones(v) if normalize else v
    if cu_seqlens is None and initial_state is None and not output_final_state:
        o = _hla_fused_op(q.contiguous(), k.contiguous(), vv.contiguous(), None if g is None else g.contiguous(), op,
                          float(scale), *powers, normalize)[0]
        finals = None
    else:
        h0 = (None, None) if initial_state is None else tuple(initial_state)
        o, *finals = FusedFunction.apply(q, k, vv, g, *h0, cu_seqlens, op, float(scale), powers, output_final_state,
                                         torch.float32 if normalize else v.dtype)
    if normalize:
        o = split_normalized(o, eps)
    return o.to(q.dtype), (STATE_TYPES[op](*finals) if output_final_state else None)
