"""Triton backward of the log-linear delta rule's level scan, its autograd.Function, and the "triton" backend.

`_delta_level_scan_bwd`, one program per (V-block, sequence, head, group of stacked states), walks the chunks backward
carrying dR [K, S * BV] (all stacked states), starting from the final states' gradient; with R the state entering
chunk c (after its reset; stored by the forward) and the forward step R' = exp(gl) R - Kd^T (W R) + zcols v_w
(mode 0; no write in mode 1):
    dL = sum_j [write j] dR'_j:   dzcols += dL v^T,   dv += zcols^T dL                          (the write)
    dU = -Kd dR':   dKd += -(W R) dR'^T,   dW += dU R^T,   d exp(gl) += <R, dR'>,   dR = exp(gl) dR' + W^T dU
    dR += q_eff^T (w * do),   dq_eff += (w * do) R^T,   dw_tj = do_t . (q_eff_t R_j)            (the read)
    dR <- where(keep, dR, 0)
The scan keeps only the dR recurrence (dR' stored per chunk, as the forward stores R) and the pieces' gradients are
formed chunk-parallel, without atomics (`_delta_level_grads`, `_delta_level_grads_rest`). In mode 1 the
gradient left at the first chunk is the initial levels' gradient.

The "triton" backend (`loglinear_delta_rule_triton`): the per-chunk pieces (E, q_eff, W, Kd, zcols: the WY/UT form
of chunk.delta_wy_pieces, (I + A)^{-1} from tril_inverse's kernel) and the levels 0..6 block (E * Lambda) V are
batched torch ops over all chunks at once (compiled by inductor on CUDA, see glue_mode), differentiated by autograd
(only the level scan, the sequential part, is a custom Triton forward and backward); the prior levels of an initial state run through the same scan kernel in mode 1; the final levels
0..6 come from the last chunk's zcols. Memory: the backward needs the state entering every chunk (nj K x V matrices
per chunk and head, in the inputs' dtype, for dW and dKd); it runs the forward scan again for them instead of keeping
them from the forward (keeping them took 3.2 GB per layer at 340m's heads and 32K tokens a step: 77 GB over 24
layers, past the H200's memory).
"""

import contextlib
import os

import torch
import triton
import triton.language as tl

from hilo_kernels.common.launch import (
    loglinear_delta_bwd_scan_cols,
    loglinear_delta_bwd_stages,
    loglinear_delta_pieces16,
    loglinear_delta_scan_cols,
)
from hilo_kernels.loglinear_attn.state import CHUNK_LEVELS, level_of, prior_level, segments
from hilo_kernels.loglinear_attn.triton_fwd import (
    CHUNK,
    CHUNK_LEVELS_C,
    LevelLayout,
    _tile_levels,
    last_chunk_levels,
    level_layout,
    pow2,
    scan_warps,
)

from .chunk import wy_after_inverse, wy_before_inverse
from .tril_inverse import unit_lower_inverse
from .triton_fwd import (
    _piece,
    _piece_t,
    _scan_masks,
    _scan_program,
    delta_level_scan_fwd,
    dot_precision,
    scaled_fp16,
    scaled_fp16_columns,
    scan_launches,
)

# The split backward's gradient kernel at 64 < K <= 128 takes one K-block where the GPU lends a program the 164 KB
# of shared memory it needs at K = V = 128 in bf16 (as sm_90 does), 64-wide blocks elsewhere: H200, 16K x 2, H = 16,
# K = V = 128, fwd+bwd 53.5 ms against 58.5 with 64-wide blocks.
_FULL_GRADS_SMEM = 168 * 1024
UNROLL_V = 256  # the widest value head whose V-block loops the split backward's gradient kernels unroll (v_span)
# The per-chunk pieces around the level scan (the tokens to chunk-major rows, the WY/UT pieces and the levels 0..6
# block (E * Lambda) V; about 20 ms of the 53 ms fwd+bwd at 16K x 2, H = 16, K = V = 128, in ~100 batched torch ops
# and autograd's backward of them) go through torch.compile(dynamic=True) on CUDA tensors, so inductor fuses their
# elementwise work and gathers, forward and backward (GLUE_BACKEND); 16-bit inputs' fp32 glue products in the forward
# use TF32, as the scan's dots do. H200, bf16, 16K x 2, H = 16, K = V = 128, fwd+bwd: eager 53.05 ms, compiled
# 46.41, compiled + TF32 45.58. The first call compiles (80 s there, once per process and dtype; other lengths
# reuse it). Off CUDA (the interpreter, where a C++ build per shape family would dominate) the glue runs eagerly.
# HILO_LOGLINEAR_DELTA_GLUE (read at each call: auto, the default; eager; compiled) overrides that choice, for a
# machine where torch.compile cannot build (docs/kernel_settings.md).
GLUES = ("auto", "eager", "compiled")
GLUE_BACKEND = "inductor"  # torch.compile backend of the compiled glue (tests on CPU use "aot_eager": no C++ build)
# The level scans' column budgets, fp16 pieces and backward stages: hilo_kernels.common.launch's LogLinearDeltaRule table
# and its head-size rules (loglinear_delta_scan_cols, loglinear_delta_pieces16, loglinear_delta_bwd_stages). H200,
# bf16, log-linear GDN 340m's heads (H = 3, K = 256, V = 512, 8K x 4) fwd+bwd: a budget of 256 columns 82.2 ms against
# 99.2 at 128; fp16 pieces 80.0 against 99.2 (at K = V = 128 48.7 against 44.1, slower, so fp32 there); 2 backward
# stages 76.5 against 80.0; together, 340m log-linear GDN compiled at 8K x 4: 17,600 tokens/s against 12,841.


def glue_mode(is_cuda: bool) -> str:
    """How the glue runs: HILO_LOGLINEAR_DELTA_GLUE (auto, eager or compiled; read at each call), auto being
    compiled for CUDA tensors and eager elsewhere."""
    choice = os.environ.get("HILO_LOGLINEAR_DELTA_GLUE", "auto").strip() or "auto"
    if choice not in GLUES:
        raise ValueError(f"HILO_LOGLINEAR_DELTA_GLUE={choice!r}: expected one of {GLUES}")
    if choice == "auto":
        return "compiled" if is_cuda else "eager"
    return choice


@triton.jit(do_not_specialize=["NL", "NW", "ROWS", "NS", "J0"])
def _delta_level_scan_bwd(q_eff, w_wy, kd, q_scale, w_scale, kd_scale, z_scale, decay, zcols, v, lam, wts, rs, dout,
                          drfin, dq_eff, dw_wy, dkd, ddecay, dzcols, dv, dlam, dwts, dr0, drs, seq_chunks, NL, NW,
                          ROWS, NS, J0,
                          K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          S: tl.constexpr, H: tl.constexpr, MODE: tl.constexpr,
                          HAS_DRFIN: tl.constexpr, STORE_DR0: tl.constexpr, PREC: tl.constexpr, SCALED: tl.constexpr):
    """Only the dR recurrence: dR' of every chunk is stored in drs (the layout of rs) and _delta_level_grads forms
    every piece's gradient from rs and drs afterwards, chunk-parallel and without atomics. SCALED: q_eff, w_wy and
    kd are scaled_fp16 values with their row scales, zcols scaled_fp16_columns values with its column scales."""
    (_i_v, i_nh, _i_n, i_h, j0, row0, nchunks, c0, o_k, m_k, o_c, col_j, col_v, m_col,
     o_v) = _scan_program(seq_chunks, J0, K, V, C, BK, BV, S, H)
    st_off = (col_j[None, :] * K + o_k[:, None]) * V + col_v[None, :]
    m_st = m_k[:, None] & (m_col & (col_j < NS))[None, :]
    d_state = tl.zeros([BK, S * BV], dtype=tl.float32)
    if HAS_DRFIN:
        d_state += tl.load(drfin + i_nh.to(tl.int64) * NS * K * V + st_off, mask=m_st, other=0.0)
        if MODE == 0:
            c_last = c0 + nchunks - 1
            on = (((c_last >> col_j) & 1) == 1) & (nchunks > 0)
            d_state = tl.where(on[None, :], d_state, 0.0)
    for it in range(nchunks):
        i = nchunks - 1 - it
        c = c0 + i
        hr = i_h * ROWS + row0 + i
        keep, _read, w = _scan_masks(lam, wts, hr, c, o_c, col_j, j0, NL, NW, C, S, BV, MODE, C)
        do_cols = _tile_levels(tl.load(dout + (hr * C + o_c[:, None]) * V + o_v[None, :], mask=(o_v < V)[None, :],
                                       other=0.0), C, S, BV)
        do_w = do_cols * w
        kdb = _piece(kd, kd_scale, hr, o_c, o_k, m_k, K, C, SCALED)
        # dR': dU = -Kd dR' (the transition R' = exp(gl) R - Kd^T U)
        d_u = -tl.dot(kdb, d_state, input_precision=PREC)
        tl.store(drs + hr * NS * K * V + st_off, d_state.to(drs.dtype.element_ty), mask=m_st)
        # dR = exp(gl) dR' + W^T dU + q_eff^T (w do)
        wt = _piece_t(w_wy, w_scale, hr, o_c, o_k, m_k, K, C, SCALED)
        d_state = d_state * tl.load(decay + hr) + tl.dot(wt, d_u, input_precision=PREC)
        qt = _piece_t(q_eff, q_scale, hr, o_c, o_k, m_k, K, C, SCALED)
        d_state += tl.dot(qt, do_w, input_precision=PREC)
        d_state = tl.where(keep[None, :], d_state, 0.0)
    if STORE_DR0:
        tl.store(dr0 + i_nh.to(tl.int64) * NS * K * V + st_off, d_state, mask=m_st)


@triton.jit
def _read_weights(lam, wts, hr, c, j, o_c, NL, NW, C: tl.constexpr, MODE: tl.constexpr):
    """State j's read weights at the chunk's tokens [C] and where they apply (mode 0: bit j of chunk c set and a
    level the scales have; mode 1: every token). Vector operands throughout: the interpreter's masks need them."""
    if MODE == 0:
        lev = CHUNK_LEVELS_C + 1 + j
        on = ((o_c * 0 + lev) < NL) & ((((o_c * 0 + c) >> j) & 1) == 1)
        w_j = tl.load(lam + (hr * C + o_c) * NL + lev, mask=on, other=0.0)
    else:
        on = (o_c * 0 + j) < NW
        w_j = tl.load(wts + (hr * C + o_c) * NW + j, mask=on, other=0.0)
    return w_j, on


@triton.jit
def _state_pair(rs, drs, off, mask):
    """R_j and dR'_j at the same offsets, in fp32."""
    return (tl.load(rs + off, mask=mask, other=0.0).to(tl.float32),
            tl.load(drs + off, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _level_tiles(rs, drs, dout, base, hr, j, v0, o_k, m_k, o_c, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                 BV: tl.constexpr):
    """State j's R_j and dR'_j tiles [BK, BV] at value columns v0.., the chunk's output gradient [C, BV] there, and
    the columns (o_v) and their mask."""
    o_v = v0 + tl.arange(0, BV)
    m_v = o_v < V
    state, d_state = _state_pair(rs, drs, base + (j * K + o_k[:, None]) * V + o_v[None, :], m_k[:, None] & m_v[None, :])
    dob = tl.load(dout + (hr * C + o_c[:, None]) * V + o_v[None, :], mask=m_v[None, :], other=0.0)
    return state, d_state, dob, o_v, m_v


@triton.jit(do_not_specialize=["NL", "NW", "ROWS", "NS"])
def _delta_level_grads(w_wy, kd, lam, wts, rs, drs, dout, row_chunk, dq_eff, dw_wy, dkd, NL, NW, ROWS, NS,
                       K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BKB: tl.constexpr,
                       BV: tl.constexpr, VSPAN: tl.constexpr, MODE: tl.constexpr, PREC: tl.constexpr):
    """One program per (chunk row, head, K-block of BKB): the level scan's chunk-step gradients that are [C, K]
    tiles, from the state entering the chunk R_j (rs) and the gradient of the state leaving it dR'_j (drs), summed
    over the states j and the V-blocks inside the program (stores, no atomics). The scan's U_j = W R_j and
    dU_j = -Kd dR'_j enter only through sums over j, so with G = sum_j R_j dR'_j^T ([K, K]; its columns of this
    K-block here) and w_j the read weights:
        dKd = -sum_j U_j dR'_j^T = -W G,   dW = sum_j dU_j R_j^T = -Kd G^T,   dq_eff = sum_j (w_j do) R_j^T
    (G's K x K products cost half the per-level U_j, dU_j products, and no K-block recomputes them).
    With one K-block (BKB >= K) G^T is G's transpose: only G is accumulated, from each state tile loaded once
    (with K-blocks, G[:, kb] and G^T[:, kb] are different slices, so both are, and the kb rows are loaded again).
    The rest (read weights, decay, the write) is _delta_level_grads_rest."""
    r, i_h, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hr = (i_h * ROWS + r).to(tl.int64)
    c = tl.load(row_chunk + r)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_kb = kb * BKB + tl.arange(0, BKB)
    m_kb = o_kb < K
    FULL: tl.constexpr = BKB >= BK  # one K-block: G^T is G's transpose
    g_cols = tl.zeros([BK, BKB], dtype=tl.float32)  # G[:, kb] = sum_j R_j dR'_j[kb]^T
    if not FULL:
        gt_cols = tl.zeros([BK, BKB], dtype=tl.float32)  # G^T[:, kb] = sum_j dR'_j R_j[kb]^T
    acc_q = tl.zeros([C, BKB], dtype=tl.float32)
    base = hr * NS * K * V
    for j in range(NS):
        w_j, _ = _read_weights(lam, wts, hr, c, j, o_c, NL, NW, C, MODE)
        for v_lo in range(0, V, VSPAN):  # v_span: one trip, unrolled, up to V = 256; a loop of BV-blocks above
            for dv0 in tl.static_range(0, VSPAN, BV):
                state, d_state, dob, o_v, m_v = _level_tiles(rs, drs, dout, base, hr, j, v_lo + dv0, o_k, m_k, o_c, K,
                                                             V, C, BV)
                if FULL:
                    g_cols += tl.dot(state, tl.trans(d_state), input_precision=PREC)
                    acc_q += tl.dot(dob * w_j[:, None], tl.trans(state), input_precision=PREC)
                else:
                    state_t, d_state_t = _state_pair(rs, drs, base + (j * K + o_kb[None, :]) * V + o_v[:, None],
                                                     m_kb[None, :] & m_v[:, None])  # [BV, BKB]
                    g_cols += tl.dot(state, d_state_t, input_precision=PREC)
                    gt_cols += tl.dot(d_state, state_t, input_precision=PREC)
                    acc_q += tl.dot(dob * w_j[:, None], state_t, input_precision=PREC)
    out = (hr * C + o_c[:, None]) * K + o_kb[None, :]
    wb = tl.load(w_wy + (hr * C + o_c[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0)
    tl.store(dkd + out, -tl.dot(wb, g_cols, input_precision=PREC), mask=m_kb[None, :])
    kdb = tl.load(kd + (hr * C + o_c[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0)
    if FULL:
        tl.store(dw_wy + out, -tl.dot(kdb, tl.trans(g_cols), input_precision=PREC), mask=m_kb[None, :])
    else:
        tl.store(dw_wy + out, -tl.dot(kdb, gt_cols, input_precision=PREC), mask=m_kb[None, :])
    tl.store(dq_eff + out, acc_q, mask=m_kb[None, :])


@triton.jit(do_not_specialize=["NL", "NW", "ROWS", "NS"])
def _delta_level_grads_rest(q_eff, zcols, v, lam, wts, rs, drs, dout, row_chunk, ddecay, dzcols, dv, dlam, dwts,
                            NL, NW, ROWS, NS, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                            BV: tl.constexpr, VSPAN: tl.constexpr, MODE: tl.constexpr, PREC: tl.constexpr):
    """One program per (chunk row, head): the read weights' gradient dw_tj = do_t . (q_eff_t R_j), the decay's
    d exp(gl) = sum_j <R_j, dR'_j>, and in mode 0 the write's: d_local = sum_{j not read} dR'_j,
    dzcols = d_local v^T, dv = zcols^T d_local."""
    r, i_h = tl.program_id(0), tl.program_id(1)
    hr = (i_h * ROWS + r).to(tl.int64)
    c = tl.load(row_chunk + r)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    qe = tl.load(q_eff + (hr * C + o_c[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0)
    acc_decay = tl.zeros([BV], dtype=tl.float32)
    base = hr * NS * K * V
    for j in range(NS):
        _, on = _read_weights(lam, wts, hr, c, j, o_c, NL, NW, C, MODE)
        d_wj = tl.zeros([C], dtype=tl.float32)
        for v_lo in range(0, V, VSPAN):  # v_span: one trip, unrolled, up to V = 256; a loop of BV-blocks above
            for dv0 in tl.static_range(0, VSPAN, BV):
                # (named, not "_": a name assigned in a loop is loop-carried and must keep one type)
                state, d_state, dob, _o_v, _m_v = _level_tiles(rs, drs, dout, base, hr, j, v_lo + dv0, o_k, m_k, o_c,
                                                               K, V, C, BV)
                d_wj += tl.sum(tl.dot(qe, state, input_precision=PREC) * dob, 1)
                acc_decay += tl.sum(state * d_state, 0)
        if MODE == 0:
            tl.store(dlam + (hr * C + o_c) * NL + CHUNK_LEVELS_C + 1 + j, d_wj, mask=on)
        else:
            tl.store(dwts + (hr * C + o_c) * NW + j, d_wj, mask=on)
    tl.store(ddecay + hr, tl.sum(acc_decay, 0))
    if MODE == 0:
        # the write: zcols v added to every level not read at c
        dzc = tl.zeros([BK, C], dtype=tl.float32)  # summed over the V-blocks
        zc_t = tl.load(zcols + (hr * K + o_k[None, :]) * C + o_c[:, None], mask=m_k[None, :], other=0.0)
        for v_lo in range(0, V, VSPAN):  # v_span: one trip, unrolled, up to V = 256; a loop of BV-blocks above
            for dv0 in tl.static_range(0, VSPAN, BV):
                o_v = v_lo + dv0 + tl.arange(0, BV)
                m_v = o_v < V
                d_local = tl.zeros([BK, BV], dtype=tl.float32)
                for j in range(NS):
                    if ((c >> j) & 1) == 0:
                        off = base + (j * K + o_k[:, None]) * V + o_v[None, :]
                        d_local += tl.load(drs + off, mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)
                vb = tl.load(v + (hr * C + o_c[:, None]) * V + o_v[None, :], mask=m_v[None, :], other=0.0)
                dzc += tl.dot(d_local, tl.trans(vb), input_precision=PREC)
                tl.store(dv + (hr * C + o_c[:, None]) * V + o_v[None, :],
                         tl.dot(zc_t, d_local, input_precision=PREC), mask=m_v[None, :])
        tl.store(dzcols + (hr * K + o_k[:, None]) * C + o_c[None, :], dzc, mask=m_k[:, None])


def _scan_pieces(q_eff, w_wy, kd, zcols, in_dtype):
    """((q_eff, w_wy, kd, zcols) as the level scans read them, their scales or None): where loglinear_delta_pieces16
    says so (16-bit inputs at K > 128 by default), scaled_fp16 copies (a scale per row; zcols one per column,
    scaled_fp16_columns): half the bytes of the pieces that every scan program reloads per chunk, and the products
    keep tf32's precision; otherwise the fp32 pieces themselves (fp32 inputs always: their products are exact)."""
    if not loglinear_delta_pieces16(q_eff.shape[-1], in_dtype):
        return (q_eff, w_wy, kd, zcols), None
    converted = [*(scaled_fp16(x) for x in (q_eff, w_wy, kd)), scaled_fp16_columns(zcols)]
    return tuple(x for x, _ in converted), tuple(sc for _, sc in converted)


class DeltaLevelScanFunction(torch.autograd.Function):
    """(q_eff, W, Kd, decay, zcols, v, lam or prior weights, r0) -> (reads [H, rows, C, V], final states
    [N, H, NS, K, V])."""

    @staticmethod
    def forward(ctx, q_eff, w_wy, kd, decay, zcols, v, lam, wts, r0, lay, mode, in_dtype):
        q_eff, w_wy, kd, decay, zcols, v, lam = (x.contiguous() for x in (q_eff, w_wy, kd, decay, zcols, v, lam))
        wts = None if wts is None else wts.contiguous()
        r0 = None if r0 is None else r0.contiguous()
        (qp, wp, kp, zp), scales = _scan_pieces(q_eff, w_wy, kd, zcols, in_dtype)
        out, rfin, _ = delta_level_scan_fwd(qp, wp, kp, decay, zp, v, lam, wts, r0, lay, mode, in_dtype,
                                            states=False, scales=scales,
                                            cols=loglinear_delta_scan_cols(q_eff.shape[-1]))
        del qp, wp, kp, zp, scales  # the backward converts again: the fp32 pieces are saved anyway
        ctx.save_for_backward(q_eff, w_wy, kd, decay, zcols, v, lam, wts, r0)
        ctx.lay, ctx.mode, ctx.in_dtype, ctx.has_r0 = lay, mode, in_dtype, r0 is not None
        return out, rfin

    @staticmethod
    def backward(ctx, dout, drfin):
        q_eff, w_wy, kd, decay, zcols, v, lam, wts, r0 = ctx.saved_tensors
        lay, mode = ctx.lay, ctx.mode
        (qp, wp, kp, zp), scales = _scan_pieces(q_eff, w_wy, kd, zcols, ctx.in_dtype)
        # the forward kept r0 only: the scan runs again for the states entering each chunk
        rs = delta_level_scan_fwd(qp, wp, kp, decay, zp, v, lam, wts, r0, lay, mode, ctx.in_dtype, reads=False,
                                  scales=scales, cols=loglinear_delta_scan_cols(q_eff.shape[-1]))[2]
        h, rows, _, dk = q_eff.shape
        dv_ = v.shape[-1]
        nl = lam.shape[-1]
        nw = wts.shape[-1] if wts is not None else 1
        ns = nw if mode == 1 else lay.nj
        dq_eff, dw_wy, dkd = torch.zeros_like(q_eff), torch.zeros_like(w_wy), torch.zeros_like(kd)
        ddecay, dzcols, dv = torch.zeros_like(decay), torch.zeros_like(zcols), torch.zeros_like(v)
        dlam = torch.zeros_like(lam)
        dwts = None if wts is None else torch.zeros_like(wts)
        dr0 = torch.zeros(lay.n, h, ns, dk, dv_, device=v.device, dtype=torch.float32) if ctx.has_r0 else None
        # sm_90, Triton 3.6 (compiled ahead of time): within shared memory at every head size up to 256
        # (196,608 B at K = 256), without register spills up to K = V = 128
        # dR' is kept in fp32 even for bf16 inputs: Triton 3.6 on the H200 faulted (illegal address) storing it
        # converted to bf16 from the 8-warp scan at K = 128, V = 16 and K = 256, V = 128 (fp32 or 4 warps did not),
        # and fp32 spares the gradients a rounding
        drs = torch.zeros(rs.shape, device=rs.device, dtype=torch.float32)
        dout = dout.contiguous()
        prec = dot_precision(ctx.in_dtype)
        for j0, s, groups, bv in scan_launches(lay, mode, ns, dk, dv_, loglinear_delta_bwd_scan_cols(dk)):
            _delta_level_scan_bwd[(triton.cdiv(dv_, bv), lay.n * h, groups)](
                qp, wp, kp, *(scales or (q_eff,) * 4), decay, zp, v, lam, wts if wts is not None else lam, rs, dout,
                drfin.contiguous() if drfin is not None else rs, dq_eff, dw_wy, dkd, ddecay, dzcols, dv, dlam,
                dwts if dwts is not None else dlam, dr0 if dr0 is not None else dlam, drs, lay.seq_chunks, nl, nw,
                rows, ns, j0, K=dk, V=dv_, C=CHUNK, BK=pow2(dk), BV=bv, S=s, H=h, MODE=mode,
                HAS_DRFIN=drfin is not None, STORE_DR0=dr0 is not None, PREC=prec,
                SCALED=scales is not None, num_warps=scan_warps(pow2(dk), s * bv),
                num_stages=loglinear_delta_bwd_stages(dk, ctx.in_dtype))
        if rows:
            # K <= 64, or K <= 128 where the GPU lends the shared memory: one K-block (G accumulated alone, each state
            # tile loaded once); otherwise 64-wide K-blocks (sm_90, K = V = 128, bf16: 98 KB of shared memory, two
            # programs an SM, against 164 KB and one for the single block, which was 5 ms faster at 16K x 2, H = 16)
            full = dk <= (128 if _smem_optin(v.device) >= _FULL_GRADS_SMEM else 64)
            bkb, bv_g = (pow2(dk) if full else 64), min(pow2(dv_), 32)
            vspan = v_span(dv_, bv_g)
            wts_ = wts if wts is not None else lam
            _delta_level_grads[(rows, h, triton.cdiv(dk, bkb))](
                w_wy, kd, lam, wts_, rs, drs, dout, lay.row_chunk, dq_eff, dw_wy, dkd, nl, nw, rows, ns,
                K=dk, V=dv_, C=CHUNK, BK=pow2(dk), BKB=bkb, BV=bv_g, VSPAN=vspan, MODE=mode, PREC=prec,
                num_warps=8, num_stages=1)  # one stage: pipelined loads would double its staged tiles
            _delta_level_grads_rest[(rows, h)](
                q_eff, zcols, v, lam, wts_, rs, drs, dout, lay.row_chunk, ddecay, dzcols, dv, dlam,
                dwts if dwts is not None else dlam, nl, nw, rows, ns, K=dk, V=dv_, C=CHUNK, BK=pow2(dk), BV=bv_g,
                VSPAN=vspan, MODE=mode, PREC=prec, num_warps=8, num_stages=1)
        return (dq_eff, dw_wy, dkd, ddecay, (dzcols if mode == 0 else None), (dv if mode == 0 else None),
                (dlam if mode == 0 else None), dwts, dr0, None, None, None)


def v_span(dv: int, bv: int) -> int:
    """VSPAN of the split backward's gradient kernels, whose loops over the BV-blocks of V are
    `for v_lo in range(0, V, VSPAN)` around an unrolled `tl.static_range(0, VSPAN, BV)`: up to UNROLL_V columns all
    of V (one trip, unrolled whole: the form timed on the H200), wider value heads one BV-block (a plain loop).
    sm_90, Triton 3.6, bf16, K = 256 (compiled ahead of time): at V = 512, _delta_level_grads unrolled whole
    spills 864 B per thread (V = 256: 464 B), in unrolled spans of 256 columns 1,000 B, as a plain loop 104 B."""
    return triton.cdiv(dv, bv) * bv if dv <= UNROLL_V else bv


def _smem_optin(device: torch.device) -> int:
    """The shared memory one program may opt in to on device (bytes); unbounded under the interpreter."""
    if device.type != "cuda":
        return 1 << 30
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def _glue_before(q, k, v, g, beta, lam, chunk_pos, rows: int, scale):
    """Token-major [TT, H, D] inputs -> their fp32 chunk rows [H, rows, C, D] (chunk_pos: each token's place in the
    rows; q scaled; g, beta, lam [.., C] / [.., C, L]), gamma (in-chunk cumsum of g) and the pieces before the
    inverse, A and Q K^T * Gamma."""
    qc, kc, vc = (_rows(x, chunk_pos, rows) for x in (q.float() * scale, k.float(), v.float()))
    gamma = _rows(g.float(), chunk_pos, rows)[..., 0].cumsum(-1)
    bc = _rows(beta.float(), chunk_pos, rows)[..., 0]
    lc = _rows(lam, chunk_pos, rows)
    a, qk = wy_before_inverse(qc, kc, gamma, bc)
    return qc, kc, vc, gamma, bc, lc, a, qk


def _glue_after(inv, qc, kc, vc, gamma, bc, lc, qk, lev_in, pad_levels: int):
    """The pieces after the inverse (E, q_eff, W, Kd, zcols), the levels 0..6 block (E * Lambda) V with Lambda[t, s] =
    lambda_t[bit_length(t xor s)] (lev_in: those levels; lc padded by pad_levels zero levels), and exp(gamma_C)."""
    e, q_eff, w_wy, kd, zcols = wy_after_inverse(inv, qc, kc, gamma, bc, qk)
    h, rows = qc.shape[:2]
    lam_in = torch.gather(torch.nn.functional.pad(lc, (0, pad_levels)), -1, lev_in.expand(h, rows, CHUNK, CHUNK))
    return (e * lam_in) @ vc, q_eff, w_wy, kd, zcols, gamma[..., -1].exp()


_COMPILED_GLUE: dict = {}


def _glue_functions(mode: str):
    """(before, after): the functions above, or their torch.compile'd forms (built once per backend)."""
    if mode == "eager":
        return _glue_before, _glue_after
    key = GLUE_BACKEND
    if key not in _COMPILED_GLUE:
        _COMPILED_GLUE[key] = tuple(_named_failure(torch.compile(f, backend=key, dynamic=True, fullgraph=True))
                                    for f in (_glue_before, _glue_after))
    return _COMPILED_GLUE[key]


def _named_failure(compiled):
    """compiled, with a failure to compile (dynamo or the backend, at a first call) raised as an error that names
    the option that avoids it."""
    def call(*args):
        try:
            return compiled(*args)
        except torch._dynamo.exc.TorchDynamoException as err:  # BackendCompilerFailed is one
            raise RuntimeError("loglinear_delta_rule: torch.compile of its per-chunk glue failed (above); "
                               "HILO_LOGLINEAR_DELTA_GLUE=eager runs the glue without it") from err
    return call


@contextlib.contextmanager
def _glue_precision(in_dtype: torch.dtype):
    """TF32 products in the glue's forward for 16-bit inputs; fp32 inputs as torch is set (a compiled glue is
    specialised on the setting: dynamo guards on it). Its backward runs later, under autograd, with torch's own
    setting (fp32 products by default), as when it was timed."""
    if in_dtype == torch.float32:
        yield
        return
    flag = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = flag


def _rows(x, chunk_pos, rows: int):
    """[TT, H, D] token-major -> [H, rows, C, D] chunk-major, contiguous, zeros in the padding (chunk_pos: each
    token's place in the rows)."""
    h, d = x.shape[1:]
    flat = x.new_zeros(h, rows * CHUNK, d).index_copy(1, chunk_pos, x.transpose(0, 1))
    return flat.reshape(h, rows, CHUNK, d)


def _to_chunks(x, lay: LevelLayout):
    """[TT, H, D] token-major -> [H, rows, C, D] chunk-major, contiguous, with zeros in the padding (differentiable).
    Contiguous in one pass: a permuted view would be copied again by every batched matmul that reads it."""
    return _rows(x, lay.chunk_pos, lay.rows)


def _prior_weights(lam, segs, starts, t):
    """Per token [TT, H, L]: lambda_t[max(l, bit_length(t xor (p0 - 1)))] for sequences with p0 > 0, else 0."""
    tt, h, nl = lam.shape
    idx = torch.zeros(tt, nl, dtype=torch.int64)
    on = torch.zeros(tt, dtype=torch.bool)
    for (row, s, e), p0 in zip(segs, starts):
        if p0 > 0 and e > s:
            idx[row * t + s: row * t + e] = prior_level(p0 + torch.arange(e - s), p0, nl)
            on[row * t + s: row * t + e] = True
    idx, on = idx.to(lam.device), on.to(lam.device)
    return torch.gather(lam, 2, idx[:, None, :].expand(tt, h, nl)) * on[:, None, None]


def loglinear_delta_rule_triton(q, k, v, beta, g, level_scales, scale, initial_state, output_final_state,
                                cu_seqlens, starts):
    """Triton backend of hilo_kernels.loglinear_delta_rule: (o [B, T, H, V] in v's dtype, final levels
    [N, H, L, K, V] fp32 or None)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    nl = level_scales.shape[-1]
    segs = segments(b, t, cu_seqlens)
    lay = level_layout(tuple(segs), tuple(starts), t, q.device)
    if lay.rows == 0:
        o = v.new_zeros(b, t, h, dv)
        return o, (None if not output_final_state else _empty_finals(initial_state, starts, h, nl, dk, dv, q))
    flat = (lambda x: x.reshape(b * t, h, -1))
    glue = glue_mode(q.is_cuda)
    before, after = _glue_functions(glue)
    g_tok = flat(g) if g is not None else q.new_zeros(b * t, h, 1, dtype=torch.float32)
    lam_tok = flat(level_scales).float()
    offs = torch.arange(CHUNK, device=q.device)
    nl_int = max(nl, CHUNK_LEVELS + 1)
    lev_in = level_of(offs[:, None], offs[None, :]).clamp(max=nl_int - 1)
    with _glue_precision(q.dtype):
        qc, kc, vc, gamma, bc, lc, a, qk = before(flat(q), flat(k), flat(v), g_tok, flat(beta), lam_tok,
                                                  lay.chunk_pos, lay.rows, scale)
        inv = unit_lower_inverse(a, "triton")
        o, q_eff, w_wy, kd, zcols, decay = after(inv, qc, kc, vc, gamma, bc, lc, qk, lev_in, nl_int - nl)
    has_prior = initial_state is not None and any(p > 0 for p in starts)
    wts = _to_chunks(_prior_weights(lam_tok, segs, starts, t), lay) if has_prior else None
    rfin = pfin = None
    if lay.nj:
        inter, rfin = DeltaLevelScanFunction.apply(q_eff, w_wy, kd, decay, zcols, vc, lc, None, None, lay, 0, q.dtype)
        o = o + inter
    if has_prior:
        inter, pfin = DeltaLevelScanFunction.apply(q_eff, w_wy, kd, decay, zcols, vc, lc, wts,
                                                   initial_state.levels.float(), lay, 1, q.dtype)
        o = o + inter
    o = o.permute(1, 2, 0, 3).reshape(lay.rows * CHUNK, h, dv)[lay.chunk_pos].reshape(b, t, h, dv)
    if not output_final_state:
        return o.to(v.dtype), None
    # levels 0..6 from the last chunk's zcols (column s = P_{end<-s} beta_s k_s; zero on padding)
    zl = zcols[:, lay.last_rows].permute(1, 3, 0, 2) * lay.nonempty_mask[:, None, None, None]  # [N, C, H, K]
    final = last_chunk_levels(zl, vc[:, lay.last_rows].permute(1, 2, 0, 3), lay, nl)
    if lay.nj:
        final = torch.cat([final[:, :, : CHUNK_LEVELS + 1],
                           final[:, :, CHUNK_LEVELS + 1: CHUNK_LEVELS + 1 + lay.nj] + rfin[:, :, : lay.nj],
                           final[:, :, CHUNK_LEVELS + 1 + lay.nj:]], 2)
    if has_prior:
        final = final + torch.einsum("nlm,nhlkv->nhmkv", lay.prior_moves(nl, q.device), pfin)
    return o.to(v.dtype), final


def _empty_finals(initial_state, starts, h, nl, dk, dv, q):
    """Final levels when every sequence is empty: the initial levels (or zeros) unchanged."""
    if initial_state is not None:
        return initial_state.levels.float()
    return q.new_zeros(len(starts), h, nl, dk, dv, dtype=torch.float32)
