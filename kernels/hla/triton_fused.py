"""Triton kernels of SPEC §3's chunked second-order algorithm for hla2, forward and backward (backend "fused").

Per head, chunks of BT = 64 tokens, q^ = scale * q, l the in-chunk inclusive cumsum of g, l_C its last value,
Gamma^(p)_ij = exp(p (l_i - l_j)) [j <= i], and (a, b) = (p_in, p_out) = (2, 1) for decay "d1", (1, 2) for "d2":

    K~ = e^{a l} Q^ S_in + (Gamma^(a) * Q^ K^T) K          S_out = e^{a l_C} S_in + K^T diag(e^{a (l_C - l)}) K
    O  = e^{b l} Q^ F_in + (Gamma^(b) * Q^ K~^T) V         F_out = e^{b l_C} F_in + K~^T diag(e^{b (l_C - l)}) V

S (K x K) and F (K x V) are carried in fp32 from chunk to chunk; every exponent is <= 0. Forward, four launches:
  1. `_state_scan` over K~-free inputs: S_in of every chunk (sequential per (document, head, K-block, K-block)),
  2. `_chunk_out` with (keys, values, state) = (K, K, S_in): K~ for all chunks in parallel (fp32),
  3. `_state_scan` with (K~, V): F_in of every chunk (sequential per (document, head, K-block, V-block)),
  4. `_chunk_out` with (K~, V, F_in): O for all chunks in parallel.
Backward, the same four in reverse (dF carried backwards, then dS):
  1. `_state_scan` reversed with (Q^, dO): dF_out of every chunk, and d F_0,
  2. `_outer_grads` per chunk: dK~ = e^{b(l_C - l)} (V dF_out^T) + dA^T Q^, dV, the outer pass's part of dq and
     of the gate gradient (dA = Gamma^(b) * dO V^T),
  3. `_state_scan` reversed with (Q^, dK~): dS_out of every chunk, and d S_0,
  4. `_inner_grads` per chunk: dq, dk (k enters S as key and as value) and the gate partial.
Gate gradient: each pass decays by exp(p (G_t - G_s)) with G the in-document cumsum of g, so
dL/dG_t = b (q^_t.dq^out_t - k~_t.dk~_t) + a (q^_t.dq^in_t - k_t.dk^key_t), plus b <F_T, dF_T> + a <S_T, dS_T> at
a document's last token, and dg_t = sum_{s >= t in its document} dL/dG_s (as in linear_attn's backward).

Chunk states S_in, F_in and K~ are kept in fp32 for the backward. Dots run on fp32 operands ("ieee" for fp32
inputs, tf32 for fp16/bf16 ones: K~ and the states grow with t, so bf16 operands would cost accuracy). Chunk
tables come from kernels.common.varlen (no host sync) and T is not specialised on, so a new T never recompiles.
Head dims: K and the value columns (V, plus one with normalize=True) up to MAX_DIM.
"""

import torch
import triton
import triton.language as tl

from kernels.linear_attn.triton_bwd import _segment_reverse_cumsum
from kernels.linear_attn.triton_fwd import BT, Layout, _chunk_bounds, _pow2, _seq_bounds

from .state import HLA2State, decay_powers, split_normalized, with_ones

MAX_DIM = 128  # the per-chunk gradient kernels hold whole K x K and K x V tiles


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


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
        xb = tl.load(x + (o_t[:, None] * H + i_h) * DX + o_x[None, :], mask=m_t[:, None] & (o_x[None, :] < DX),
                     other=0.0).to(tl.float32)
        yb = tl.load(y + (o_t[:, None] * H + i_h) * DY + o_y[None, :], mask=m_t[:, None] & (o_y[None, :] < DY),
                     other=0.0).to(tl.float32)
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
        state += tl.dot(tl.trans(xb), yb, input_precision=PREC)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * DX * DY + xy_off, state, mask=m_xy)


@triton.jit(do_not_specialize=["T", "NT"])
def _chunk_out(q, x, y, g, hs, o, table, scale, T, NT,
               H: tl.constexpr, K: tl.constexpr, DY: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               BY: tl.constexpr, POWER: tl.constexpr, HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr,
               PREC: tl.constexpr):
    """o = scale (e^{p l} (q hs_in) + (Gamma^(p) * q x^T) y) for one (DY-block, chunk, head):
    q, x [TT, H, K], y [TT, H, DY], hs [rows, H, K, DY] (the state entering each chunk)."""
    i_y, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = _chunk_bounds(table, i_c, T, NT, BT, IS_VARLEN)
    if start >= end:
        return
    o_t = start + tl.arange(0, BT)
    m_t = o_t < end
    o_y = i_y * BY + tl.arange(0, BY)
    acc = tl.zeros([BT, BY], dtype=tl.float32)
    scores = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k[None, :] < K)
        qb = tl.load(q + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        xb = tl.load(x + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        hb = tl.load(hs + (i_c.to(tl.int64) * H + i_h) * K * DY + o_k[:, None] * DY + o_y[None, :],
                     mask=(o_k[:, None] < K) & (o_y[None, :] < DY), other=0.0)
        acc += tl.dot(qb, hb, input_precision=PREC)
        scores += tl.dot(qb, tl.trans(xb), input_precision=PREC)
    o_i = tl.arange(0, BT)
    causal = o_i[:, None] >= o_i[None, :]
    if HAS_G:
        gc = tl.cumsum(tl.load(g + o_t * H + i_h, mask=m_t, other=0.0).to(tl.float32) * POWER, 0)
        acc *= tl.exp(gc)[:, None]
        scores *= tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
    scores = tl.where(causal, scores, 0.0)
    yb = tl.load(y + (o_t[:, None] * H + i_h) * DY + o_y[None, :], mask=m_t[:, None] & (o_y[None, :] < DY),
                 other=0.0).to(tl.float32)
    acc += tl.dot(scores, yb, input_precision=PREC)
    tl.store(o + (o_t[:, None] * H + i_h) * DY + o_y[None, :], (acc * scale).to(o.dtype.element_ty),
             mask=m_t[:, None] & (o_y[None, :] < DY))


@triton.jit(do_not_specialize=["T", "NT"])
def _outer_grads(q, kt, v, g, do, fs, dfs, dq_out, dkt, dv, r_out, table, scale, T, NT,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, POWER: tl.constexpr, HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr,
                 PREC: tl.constexpr):
    """The outer pass O = LA(Q^, K~, V; b g) of one (chunk, head): dv, dK~ (fp32), its part of dq (fp32) and
    b (q^.dq^ - k~.dk~) (the gate partial). fs / dfs: F_in and dF_out of each chunk [rows, H, K, V] fp32."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    start, end = _chunk_bounds(table, i_c, T, NT, BT, IS_VARLEN)
    if start >= end:
        return
    o_t = start + tl.arange(0, BT)
    m_t = o_t < end
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_tk = m_t[:, None] & (o_k[None, :] < K)
    m_tv = m_t[:, None] & (o_v[None, :] < V)
    tok_k = (o_t[:, None] * H + i_h) * K + o_k[None, :]
    tok_v = (o_t[:, None] * H + i_h) * V + o_v[None, :]
    state_off = (i_c.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    o_i = tl.arange(0, BT)
    causal = o_i[:, None] >= o_i[None, :]
    qh = tl.load(q + tok_k, mask=m_tk, other=0.0).to(tl.float32) * scale
    ktb = tl.load(kt + tok_k, mask=m_tk, other=0.0)
    dob = tl.load(do + tok_v, mask=m_tv, other=0.0).to(tl.float32)
    if HAS_G:
        gb = tl.load(g + o_t * H + i_h, mask=m_t, other=0.0).to(tl.float32) * POWER
        gc = tl.cumsum(gb, 0)
        gl = tl.sum(gb, 0)
        decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
        to_end = tl.exp(gl - gc)
    else:
        decay = tl.where(causal, 1.0, 0.0)
    # dv = e^{b (l_C - l)} (K~ dF_out) + (Gamma * Q^ K~^T)^T dO
    dfb = tl.load(dfs + state_off, mask=m_kv, other=0.0)
    acc = tl.dot(ktb, dfb, input_precision=PREC)
    if HAS_G:
        acc *= to_end[:, None]
    p_t = tl.trans(tl.dot(qh, tl.trans(ktb), input_precision=PREC) * decay)
    acc += tl.dot(p_t, dob, input_precision=PREC)
    tl.store(dv + tok_v, acc.to(dv.dtype.element_ty), mask=m_tv)
    # dA = Gamma * (dO V^T);  dq^ = e^{b l} (dO F_in^T) + dA K~
    vb = tl.load(v + tok_v, mask=m_tv, other=0.0).to(tl.float32)
    fb = tl.load(fs + state_off, mask=m_kv, other=0.0)
    d_scores = tl.dot(dob, tl.trans(vb), input_precision=PREC) * decay
    acc_q = tl.dot(dob, tl.trans(fb), input_precision=PREC)
    if HAS_G:
        acc_q *= tl.exp(gc)[:, None]
    acc_q += tl.dot(d_scores, ktb, input_precision=PREC)
    tl.store(dq_out + tok_k, acc_q * scale, mask=m_tk)
    # dK~ = e^{b (l_C - l)} (V dF_out^T) + dA^T Q^
    acc_k = tl.dot(vb, tl.trans(dfb), input_precision=PREC)
    if HAS_G:
        acc_k *= to_end[:, None]
    acc_k += tl.dot(tl.trans(d_scores), qh, input_precision=PREC)
    tl.store(dkt + tok_k, acc_k, mask=m_tk)
    if HAS_G:
        r = tl.sum(qh * acc_q - ktb * acc_k, 1) * POWER
        tl.store(r_out + o_t * H + i_h, r, mask=m_t)


@triton.jit(do_not_specialize=["T", "NT"])
def _inner_grads(q, k, g, dkt, ss, dss, dq_outer, r_outer, dq, dk, r_out, table, scale, T, NT,
                 H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, POWER: tl.constexpr,
                 HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    """The inner pass K~ = LA(Q^, K, K; a g) of one (chunk, head), given dK~: dq (plus the outer pass's part),
    dk (as key and as value) and the whole gate partial. ss / dss: S_in and dS_out [rows, H, K, K] fp32."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    start, end = _chunk_bounds(table, i_c, T, NT, BT, IS_VARLEN)
    if start >= end:
        return
    o_t = start + tl.arange(0, BT)
    m_t = o_t < end
    o_k = tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k[None, :] < K)
    tok_k = (o_t[:, None] * H + i_h) * K + o_k[None, :]
    state_off = (i_c.to(tl.int64) * H + i_h) * K * K + o_k[:, None] * K + o_k[None, :]
    m_kk = (o_k[:, None] < K) & (o_k[None, :] < K)
    o_i = tl.arange(0, BT)
    causal = o_i[:, None] >= o_i[None, :]
    qh = tl.load(q + tok_k, mask=m_tk, other=0.0).to(tl.float32) * scale
    kb = tl.load(k + tok_k, mask=m_tk, other=0.0).to(tl.float32)
    dktb = tl.load(dkt + tok_k, mask=m_tk, other=0.0)
    if HAS_G:
        gb = tl.load(g + o_t * H + i_h, mask=m_t, other=0.0).to(tl.float32) * POWER
        gc = tl.cumsum(gb, 0)
        gl = tl.sum(gb, 0)
        decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
        to_end = tl.exp(gl - gc)
    else:
        decay = tl.where(causal, 1.0, 0.0)
    # dA = Gamma * (dK~ K^T);  dq^ = e^{a l} (dK~ S_in^T) + dA K
    d_scores = tl.dot(dktb, tl.trans(kb), input_precision=PREC) * decay
    sb = tl.load(ss + state_off, mask=m_kk, other=0.0)
    acc_q = tl.dot(dktb, tl.trans(sb), input_precision=PREC)
    if HAS_G:
        acc_q *= tl.exp(gc)[:, None]
    acc_q += tl.dot(d_scores, kb, input_precision=PREC)
    dq_total = acc_q * scale + tl.load(dq_outer + tok_k, mask=m_tk, other=0.0)
    tl.store(dq + tok_k, dq_total.to(dq.dtype.element_ty), mask=m_tk)
    # k as key: e^{a (l_C - l)} (K dS_out^T) + dA^T Q^;  as value: e^{a (l_C - l)} (K dS_out) + (Gamma * Q^ K^T)^T dK~
    dsb = tl.load(dss + state_off, mask=m_kk, other=0.0)
    acc_k = tl.dot(kb, tl.trans(dsb), input_precision=PREC)
    if HAS_G:
        acc_k *= to_end[:, None]
    acc_k += tl.dot(tl.trans(d_scores), qh, input_precision=PREC)
    if HAS_G:
        r = tl.sum(qh * acc_q - kb * acc_k, 1) * POWER + tl.load(r_outer + o_t * H + i_h, mask=m_t, other=0.0)
        tl.store(r_out + o_t * H + i_h, r, mask=m_t)
    as_value = tl.dot(kb, dsb, input_precision=PREC)
    if HAS_G:
        as_value *= to_end[:, None]
    acc_k += as_value
    p_t = tl.trans(tl.dot(qh, tl.trans(kb), input_precision=PREC) * decay)
    acc_k += tl.dot(p_t, dktb, input_precision=PREC)
    tl.store(dk + tok_k, acc_k.to(dk.dtype.element_ty), mask=m_tk)

def _scan_blocks(dx: int, dy: int, programs: int) -> tuple[int, int]:
    """Tiles of the sequential scans: 64 x 64, or 64 x 32 when that leaves the GPU under-filled."""
    bx, by = _pow2(dx, hi=64), _pow2(dy, hi=64)
    if programs * triton.cdiv(dx, bx) * triton.cdiv(dy, by) < 256 and by > 32:
        by = 32
    return bx, by


def _scan(x, y, g, power, h0, lay: Layout, reverse: bool, x_scale: float, store_last: bool):
    """Per-chunk states hs [rows, H, DX, DY] fp32 and the last state [N, H, DX, DY] fp32 (or None)."""
    dx, dy = x.shape[-1], y.shape[-1]
    h = lay.heads
    hs = torch.empty(lay.rows, h, dx, dy, device=x.device, dtype=torch.float32)
    ht = torch.empty(lay.n, h, dx, dy, device=x.device, dtype=torch.float32) if store_last else None
    bx, by = _scan_blocks(dx, dy, lay.n * h)
    grid = (triton.cdiv(dx, bx) * triton.cdiv(dy, by), lay.n * h)
    _state_scan[grid](x, y, g if g is not None else x, h0 if h0 is not None else hs, hs,
                      ht if ht is not None else hs, lay.bounds, lay.offsets, x_scale, lay.seqlen, lay.nt,
                      H=h, DX=dx, DY=dy, BT=BT, BX=bx, BY=by, POWER=power, REVERSE=reverse, HAS_G=g is not None,
                      HAS_H0=h0 is not None, STORE_HT=store_last, IS_VARLEN=lay.varlen, PREC=_precision(x),
                      num_warps=4, num_stages=2)
    return hs, ht


def _out(q, x, y, g, power, hs, scale, lay: Layout, out_dtype, prec):
    dk, dy = q.shape[-1], y.shape[-1]
    o = torch.empty(*y.shape, device=y.device, dtype=out_dtype)
    by = _pow2(dy, hi=64)
    grid = (triton.cdiv(dy, by), lay.rows, lay.heads)
    _chunk_out[grid](q, x, y, g if g is not None else q, hs, o, lay.table, scale, lay.seqlen, lay.nt,
                     H=lay.heads, K=dk, DY=dy, BT=BT, BK=_pow2(dk), BY=by, POWER=power, HAS_G=g is not None,
                     IS_VARLEN=lay.varlen, PREC=prec, num_warps=4, num_stages=2)
    return o


def hla2_fused_fwd(q, k, v, g, scale, powers, s0, f0, lay: Layout, store_final: bool, out_dtype):
    """q, k [TT, H, K], v [TT, H, V] contiguous, g [TT, H] fp32 or None ->
    (o [TT, H, V] in out_dtype, S_T, F_T (fp32 or None), S_in, F_in, K~ (fp32, kept for the backward))."""
    p_in, p_out = powers
    prec = _precision(q)
    s_in, s_t = _scan(k, k, g, p_in, s0, lay, False, 1.0, store_final)
    kt = _out(q, k, k, g, p_in, s_in, scale, lay, torch.float32, prec)
    f_in, f_t = _scan(kt, v, g, p_out, f0, lay, False, 1.0, store_final)
    o = _out(q, kt, v, g, p_out, f_in, scale, lay, out_dtype, prec)
    return o, s_t, f_t, s_in, f_in, kt


def hla2_fused_bwd(q, k, v, g, kt, s_in, f_in, s_t, f_t, do, ds_t, df_t, scale, powers, lay: Layout,
                   need_h0: bool):
    """Gradients (dq, dk, dv, dg or None, dS_0 or None, dF_0 or None) on the packed layout."""
    p_in, p_out = powers
    dk_, dv_ = q.shape[-1], v.shape[-1]
    h = lay.heads
    prec = _precision(q)
    gate = g if g is not None else q
    df_out, df0 = _scan(q, do, g, p_out, df_t, lay, True, scale, need_h0)
    dq_outer = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    dkt = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    dv = torch.empty_like(v)
    r_outer = torch.empty(lay.total, h, device=q.device, dtype=torch.float32) if g is not None else None
    _outer_grads[(lay.rows, h)](q, kt, v, gate, do, f_in, df_out, dq_outer, dkt, dv,
                                r_outer if r_outer is not None else dkt, lay.table, scale, lay.seqlen, lay.nt,
                                H=h, K=dk_, V=dv_, BT=BT, BK=_pow2(dk_), BV=_pow2(dv_), POWER=p_out,
                                HAS_G=g is not None, IS_VARLEN=lay.varlen, PREC=prec, num_warps=8, num_stages=1)
    ds_out, ds0 = _scan(q, dkt, g, p_in, ds_t, lay, True, scale, need_h0)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    r = torch.empty_like(r_outer) if g is not None else None
    _inner_grads[(lay.rows, h)](q, k, gate, dkt, s_in, ds_out, dq_outer, r_outer if r_outer is not None else dkt,
                                dq, dk, r if r is not None else dkt, lay.table, scale, lay.seqlen, lay.nt,
                                H=h, K=dk_, BT=BT, BK=_pow2(dk_), POWER=p_in, HAS_G=g is not None,
                                IS_VARLEN=lay.varlen, PREC=prec, num_warps=8, num_stages=1)
    dg = None
    if g is not None:
        if ds_t is not None or df_t is not None:
            # the final states decay as exp(p G) from each source token: b <F_T, dF_T> + a <S_T, dS_T> enters at
            # a document's last token
            term = torch.zeros(lay.n, h, device=q.device, dtype=torch.float32)
            if df_t is not None:
                term = term + p_out * (f_t * df_t).sum((-2, -1))
            if ds_t is not None:
                term = term + p_in * (s_t * ds_t).sum((-2, -1))
            if lay.varlen:
                last = (lay.bounds[1:] - 1).clamp(min=0)
                term = term * (lay.bounds[1:] > lay.bounds[:-1])[:, None]
            else:
                last = torch.arange(1, lay.n + 1, device=q.device) * lay.seqlen - 1
            r = r.index_add(0, last, term)
        dg = _segment_reverse_cumsum(r, lay)
    return dq, dk, dv, dg, ds0, df0


class HLA2FusedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, s0, f0, cu_seqlens, scale, powers, output_final_state, out_dtype):
        b, t, h, dk = q.shape
        dv = v.shape[-1]
        lay = Layout(b, t, h, cu_seqlens, q.device)
        qf, kf, vf = (x.reshape(b * t, h, x.shape[-1]).contiguous() for x in (q, k, v))
        gf = None if g is None else g.reshape(b * t, h).contiguous().float()
        s0f = None if s0 is None else s0.contiguous().float()
        f0f = None if f0 is None else f0.contiguous().float()
        o, s_t, f_t, s_in, f_in, kt = hla2_fused_fwd(qf, kf, vf, gf, scale, powers, s0f, f0f, lay,
                                                     output_final_state, out_dtype)
        ctx.save_for_backward(qf, kf, vf, gf, kt, s_in, f_in, s_t, f_t)
        ctx.lay, ctx.scale, ctx.powers, ctx.shape = lay, scale, powers, (b, t, h, dk, dv)
        ctx.h0_dtypes = (None if s0 is None else s0.dtype, None if f0 is None else f0.dtype)
        ctx.g_dtype = None if g is None else g.dtype
        return o.reshape(b, t, h, dv), s_t, f_t

    @staticmethod
    def backward(ctx, do, ds_t, df_t):
        qf, kf, vf, gf, kt, s_in, f_in, s_t, f_t = ctx.saved_tensors
        b, t, h, dk, dv = ctx.shape
        do = do.reshape(b * t, h, dv).contiguous()
        ds_t = None if ds_t is None else ds_t.contiguous().float()
        df_t = None if df_t is None else df_t.contiguous().float()
        need_h0 = ctx.h0_dtypes[0] is not None
        dq, dk_, dv_, dg, ds0, df0 = hla2_fused_bwd(qf, kf, vf, gf, kt, s_in, f_in, s_t, f_t, do, ds_t, df_t,
                                                    ctx.scale, ctx.powers, ctx.lay, need_h0)
        dg = None if dg is None else dg.reshape(b, t, h).to(ctx.g_dtype)
        ds0 = None if ds0 is None else ds0.to(ctx.h0_dtypes[0])
        df0 = None if df0 is None else df0.to(ctx.h0_dtypes[1])
        return (dq.reshape(b, t, h, dk), dk_.reshape(b, t, h, dk), dv_.reshape(b, t, h, dv), dg, ds0, df0,
                None, None, None, None, None)


def hla2_fused(q, k, v, g, decay, normalize, eps, scale, initial_state, output_final_state, cu_seqlens):
    """Backend "fused" of kernels.hla2 (same contract); inputs already validated. Returns (o in q's dtype,
    HLA2State or None). normalize=True appends a ones column to v (the denominator) and divides at the end."""
    dk, dvs = q.shape[-1], v.shape[-1] + (1 if normalize else 0)
    if dk > MAX_DIM or dvs > MAX_DIM:
        raise ValueError(f"hla2: backend='fused' supports K and value columns up to {MAX_DIM} (V + 1 with "
                         f"normalize=True), got K={dk}, {dvs}; use backend='triton' (the composition)")
    powers = decay_powers("hla2", decay)
    vv = with_ones(v) if normalize else v
    s0, f0 = (None, None) if initial_state is None else initial_state
    o, s_t, f_t = HLA2FusedFunction.apply(q, k, vv, g, s0, f0, cu_seqlens, float(scale), powers,
                                          output_final_state, torch.float32 if normalize else v.dtype)
    if normalize:
        o = split_normalized(o, eps)
    return o.to(q.dtype), (HLA2State(s_t, f_t) if output_final_state else None)
