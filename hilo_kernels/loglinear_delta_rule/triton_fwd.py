"""Triton level scan of the log-linear delta rule (forward): every chunk-level state of a (sequence, head, V-block) in
one program, moved chunk to chunk by the chunk's Householder product (two tl.dot in WY form).

Inputs are chunk-major, [H, rows, ...] fp32 (the per-chunk pieces of hilo_kernels.loglinear_delta_rule.chunk
.delta_wy_pieces on the chunks of hilo_kernels.loglinear_attn.triton_fwd.LevelLayout): q_eff [C, K] (q_eff_t S =
q_t^T P_{t<-chunk start} S), W and Kd [C, K] and decay = exp(gl) (a state through the chunk: S -> M S with the
Householder product M = exp(gl) I - Kd^T W, applied as two dots over the chunk's tokens, so K = 256 needs no
K x K tile), zcols [K, C] (column s = P_{end<-s} beta_s k_s), v [C, V].
`_delta_level_scan_fwd`, one program per (V-block, sequence, head, group of up to 8 states; reads added with fp32
atomics), carries R [K, S * BV], S stacked states:
  mode 0 (chunk levels, S = NJ): level j = 1..NJ resets at chunks c with c mod 2^j == 0, is read when bit j-1 of c
      is set (weights lambda_t[6 + j]) and written otherwise:
          R <- where(keep, R, 0);  o_t += sum_j w_tj q_eff_t R_j;  R <- M R + [write j] zcols v
      (the read and the transition's two dots on the stacked tile, zcols v [K, BV] once, copied per level)
  mode 1 (the prior levels of an initial state, S >= L): R starts at the state's levels, is never reset nor written,
      and query t reads level l with an explicit weight lambda_t[max(l, bit_length(t xor (p0 - 1)))]:  R <- M R.
It stores the state entering each chunk (after the reset; the backward's dM needs it) and the final states (mode 0:
R_j [bit j-1 of the last chunk set], the levels 7.. of the final state; mode 1: R, the prior moved to the last token).
"""

import torch
import triton
import triton.language as tl

from hilo_kernels.loglinear_attn.triton_fwd import (
    CHUNK,
    CHUNK_LEVELS_C,
    LevelLayout,
    _accumulate,
    _spread_levels,
    _tile_levels,
    pow2,
    scan_warps,
    tile_shrink,
)


@triton.jit
def _scan_masks(lam, wts, hr, c, o_c, col_j, j0, NL, NW, C: tl.constexpr, S: tl.constexpr, BV: tl.constexpr,
                MODE: tl.constexpr, R: tl.constexpr):
    """keep [S*BV] (the state survives entering chunk c), read [S*BV] and the read weights w [R, S*BV] of the
    stacked states j0 .. j0 + S - 1 (col_j: each column's state index) for the R chunk rows o_c (C: the chunk's
    row stride)."""
    o_j = j0 + tl.arange(0, S)
    if MODE == 0:
        keep = (c % (2 << col_j)) != 0
        read = ((c >> col_j) & 1) == 1
        lev = CHUNK_LEVELS_C + 1 + o_j
        w = tl.load(lam + (hr * C + o_c[:, None]) * NL + lev[None, :],
                    mask=((lev < NL) & (((c >> o_j) & 1) == 1))[None, :], other=0.0)
    else:
        keep = col_j >= 0
        read = col_j < NW
        w = tl.load(wts + (hr * C + o_c[:, None]) * NW + o_j[None, :], mask=(o_j < NW)[None, :], other=0.0)
    return keep, read, _spread_levels(w, R, S, BV)


@triton.jit
def _scan_program(seq_chunks, J0, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, S: tl.constexpr, H: tl.constexpr):
    """Where a level-scan program (forward or backward) works: its V-block, sequence and head, its first stacked
    state j0 (it carries j0 .. j0 + S - 1), the sequence's chunk rows, and the index vectors of its [BK, S * BV] tile."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    j0 = J0 + tl.program_id(2) * S  # this program's stacked states j0 .. j0 + S - 1
    i_n, i_h = i_nh // H, i_nh % H
    row0 = tl.load(seq_chunks + i_n * 3).to(tl.int64)
    nchunks = tl.load(seq_chunks + i_n * 3 + 1)
    c0 = tl.load(seq_chunks + i_n * 3 + 2).to(tl.int64)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_c = tl.arange(0, C)
    cols = tl.arange(0, S * BV)
    col_j = j0 + cols // BV
    col_v = i_v * BV + cols % BV
    m_col = col_v < V
    o_v = i_v * BV + tl.arange(0, BV)
    return i_v, i_nh, i_n, i_h, j0, row0, nchunks, c0, o_k, m_k, o_c, col_j, col_v, m_col, o_v


@triton.jit
def _scan_start(r0, i_nh, o_k, m_k, col_j, col_v, m_col, NS, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, S: tl.constexpr, HAS_R0: tl.constexpr):
    """(offsets and mask of the program's [BK, S * BV] tile in a [NS, K, V] block of states, the initial tile)."""
    st_off = (col_j[None, :] * K + o_k[:, None]) * V + col_v[None, :]
    m_st = m_k[:, None] & (m_col & (col_j < NS))[None, :]
    state = tl.zeros([BK, S * BV], dtype=tl.float32)
    if HAS_R0:
        state += tl.load(r0 + i_nh.to(tl.int64) * NS * K * V + st_off, mask=m_st, other=0.0)
    return st_off, m_st, state


@triton.jit
def _scan_final(rfin, state, i_nh, st_off, m_st, c0, nchunks, col_j, NS, K: tl.constexpr, V: tl.constexpr,
                MODE: tl.constexpr):
    """Store the final states (mode 0: the levels whose bit of the last chunk is set)."""
    if MODE == 0:
        c_last = c0 + nchunks - 1
        on = (((c_last >> col_j) & 1) == 1) & (nchunks > 0)
        state = tl.where(on[None, :], state, 0.0)
    tl.store(rfin + i_nh.to(tl.int64) * NS * K * V + st_off, state, mask=m_st)


@triton.jit
def _enter_chunk(lam, wts, rs, state, hr, c, o_r, col_j, j0, NL, NW, NS, st_off, m_st, K: tl.constexpr,
                 V: tl.constexpr, C: tl.constexpr, S: tl.constexpr, BV: tl.constexpr, MODE: tl.constexpr,
                 R: tl.constexpr, STORE_STATES: tl.constexpr):
    """A chunk's start in a forward scan: (read mask, read weights of rows o_r, the state after the chunk's level
    resets), storing that state with STORE_STATES."""
    keep, read, w = _scan_masks(lam, wts, hr, c, o_r, col_j, j0, NL, NW, C, S, BV, MODE, R)
    state = tl.where(keep[None, :], state, 0.0)
    if STORE_STATES:
        tl.store(rs + hr * NS * K * V + st_off, state.to(rs.dtype.element_ty), mask=m_st)
    return read, w, state


@triton.jit
def _piece(ptr, scales, hr, o_r, o_k, m_k, K: tl.constexpr, C: tl.constexpr, SCALED: tl.constexpr):
    """Rows o_r of a chunk row's [C, K] piece (chunk-major [H, rows, C, K]) as [len(o_r), K]: as stored, or with
    SCALED fp16 values times their row's power-of-two scale (scales [H, rows, C] fp32; scaled_fp16)."""
    x = tl.load(ptr + (hr * C + o_r[:, None]) * K + o_k[None, :], mask=m_k[None, :], other=0.0)
    if SCALED:
        x = x.to(tl.float32) * tl.load(scales + hr * C + o_r)[:, None]
    return x


@triton.jit
def _piece_t(ptr, scales, hr, o_r, o_k, m_k, K: tl.constexpr, C: tl.constexpr, SCALED: tl.constexpr):
    """_piece transposed: [K, len(o_r)]."""
    x = tl.load(ptr + (hr * C + o_r[None, :]) * K + o_k[:, None], mask=m_k[:, None], other=0.0)
    if SCALED:
        x = x.to(tl.float32) * tl.load(scales + hr * C + o_r)[None, :]
    return x


@triton.jit
def _zcols_block(zcols, z_scale, hr, o_k, m_k, o_r, K: tl.constexpr, C: tl.constexpr, SCALED: tl.constexpr):
    """Columns o_r of a chunk row's zcols [K, C] (chunk-major [H, rows, K, C]) as [K, len(o_r)]: as stored, or with
    SCALED fp16 values times their column's power-of-two scale (z_scale [H, rows, C] fp32; scaled_fp16_columns)."""
    x = tl.load(zcols + (hr * K + o_k[:, None]) * C + o_r[None, :], mask=m_k[:, None], other=0.0)
    if SCALED:
        x = x.to(tl.float32) * tl.load(z_scale + hr * C + o_r)[None, :]
    return x


def scaled_fp16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] fp32 -> (fp16 values [..., K], fp32 scales [...]) with x ~ values * scales[..., None]: each row
    scaled by a power of two to a largest magnitude in [2^14, 2^15) (below fp16's 65504), then rounded to fp16's 11
    significant bits, the bits a tf32 product keeps of it anyway (and to nearest, where tf32 truncates). Zero rows
    stay zero, inf / nan stay so; entries below 2^-24 of their row's largest lose bits."""
    _, e = torch.frexp(x.abs().amax(-1))  # largest in [2^(e - 1), 2^e)
    k = (e - 15).clamp(-126, 126)
    one = torch.ones_like(x[..., 0])
    return (x * torch.ldexp(one, -k)[..., None]).to(torch.float16), torch.ldexp(one, k)


def scaled_fp16_columns(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scaled_fp16 along the second-last axis: x [..., K, C] -> (fp16 values [..., K, C], contiguous, and a scale
    per column [..., C]), for zcols, whose column s is one token's P_{end<-s} beta_s k_s."""
    vals, scales = scaled_fp16(x.transpose(-1, -2))
    return vals.transpose(-1, -2).contiguous(), scales


@triton.jit(do_not_specialize=["NL", "NW", "ROWS", "NS", "J0"])
def _delta_level_scan_fwd(q_eff, w_wy, kd, q_scale, w_scale, kd_scale, z_scale, decay, zcols, v, lam, wts, r0, out,
                          rfin, rs, seq_chunks, NL, NW, ROWS, NS, J0,
                          K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          S: tl.constexpr, H: tl.constexpr, MODE: tl.constexpr,
                          HAS_R0: tl.constexpr, STORE_FINAL: tl.constexpr, STORE_STATES: tl.constexpr,
                          READS: tl.constexpr, PREC: tl.constexpr, SCALED: tl.constexpr):
    (_i_v, i_nh, _i_n, i_h, j0, row0, nchunks, c0, o_k, m_k, o_c, col_j, col_v, m_col,
     o_v) = _scan_program(seq_chunks, J0, K, V, C, BK, BV, S, H)
    st_off, m_st, state = _scan_start(r0, i_nh, o_k, m_k, col_j, col_v, m_col, NS, K, V, BK, BV, S, HAS_R0)
    for i in range(nchunks):
        c = c0 + i
        hr = i_h * ROWS + row0 + i
        read, w, state = _enter_chunk(lam, wts, rs, state, hr, c, o_c, col_j, j0, NL, NW, NS, st_off, m_st, K, V, C, S,
                                      BV, MODE, C, STORE_STATES)
        if READS:
            qe = _piece(q_eff, q_scale, hr, o_c, o_k, m_k, K, C, SCALED)
            reads = tl.dot(qe, state, input_precision=PREC) * w
            _accumulate(out + (hr * C + o_c[:, None]) * V + o_v[None, :], tl.sum(tl.reshape(reads, [C, S, BV]), 1),
                        mask=(o_v < V)[None, :])
        # the transition M R = exp(gl) R - Kd^T (W R): two dots over the chunk's tokens, never a K x K matrix. W is
        # used as loaded and Kd loaded after: with both [C, K] pieces live at once the K = 256 bf16 scan with reads spilled 472 B a thread and staged 160 KB on sm_90, now 8 B and 96 KB
        u = tl.dot(_piece(w_wy, w_scale, hr, o_c, o_k, m_k, K, C, SCALED), state, input_precision=PREC)
        kdb = _piece(kd, kd_scale, hr, o_c, o_k, m_k, K, C, SCALED)
        state = state * tl.load(decay + hr) - tl.dot(tl.trans(kdb), u, input_precision=PREC)
        if MODE == 0:
            zc = _zcols_block(zcols, z_scale, hr, o_k, m_k, o_c, K, C, SCALED)
            vb = tl.load(v + (hr * C + o_c[:, None]) * V + o_v[None, :], mask=(o_v < V)[None, :], other=0.0)
            local = tl.dot(zc, vb, input_precision=PREC)
            state += tl.where(read[None, :], 0.0, _tile_levels(local, BK, S, BV))
    if STORE_FINAL:
        _scan_final(rfin, state, i_nh, st_off, m_st, c0, nchunks, col_j, NS, K, V, MODE)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs: exact fp32 products; 16-bit inputs (whose pieces are still fp32 here): tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def scan_launches(lay: LevelLayout, mode: int, count: int, dk: int, dv: int,
                  cols: int | None = None) -> list[tuple[int, int, int, int]]:
    """(first state j0, stacked states S, programs along the group axis, BV) of each launch of a scan over `count`
    states (mode 0: the nj chunk levels; mode 1: the L prior levels), grouped as LevelLayout.level_groups; cols:
    the stacked-column budget (LevelLayout.scan_block_v's default unless given)."""
    shrink = tile_shrink(pow2(dk), 2)
    # at least 32 stacked columns where V allows: on the H200 (Triton 3.6) the backward scan at K = 256 with one
    # stacked state of BV = 16 ([256, 16] tiles, 8 warps; scan_cols=64, scan_levels=4) faulted with an illegal
    # address, while S = 1 x BV = 32 and S = 2 x BV = 16 ran
    return [(j0, s, groups, max(lay.scan_block_v(dv, s, shrink, cols), min(32 // s, pow2(dv))))
            for j0, s, groups in lay.level_groups(count, shrink)]


def delta_level_scan_fwd(q_eff, w_wy, kd, decay, zcols, v, lam, wts, r0, lay: LevelLayout, mode: int, in_dtype,
                         states: bool = True, reads: bool = True, scales=None, cols: int | None = None):
    """out [H, rows, C, V] (the scan's reads) and rfin [N, H, NS, K, V] (final states), fp32, and with states=True
    rs [H, rows, NS, K, V] (states entering each chunk, in the inputs' dtype; else None). reads=False runs the scan
    for rs alone (the backward's recompute: out and rfin are then None). scales: (q_eff's, w_wy's, kd's row scales, zcols' column scales) when
    those four pieces come as scaled_fp16 (scaled_fp16_columns) values, else None. cols: the stacked-column budget
    (scan_launches)."""
    h, rows, _, dk = q_eff.shape
    dv = v.shape[-1]
    nl = lam.shape[-1]
    nw = wts.shape[-1] if wts is not None else 1
    ns = nw if mode == 1 else lay.nj
    dev = q_eff.device
    out = torch.zeros(h, rows, CHUNK, dv, device=dev, dtype=torch.float32) if reads else None
    rfin = torch.zeros(lay.n, h, ns, dk, dv, device=dev, dtype=torch.float32) if reads else None
    # 16-bit inputs keep the chunk states in their dtype (as hilo_kernels.delta_rule does): half the memory
    rs = torch.empty(h, rows, ns, dk, dv, device=dev, dtype=torch.float32 if in_dtype == torch.float32 else in_dtype) \
        if states else None
    dummy = q_eff
    for j0, s, groups, bv in scan_launches(lay, mode, ns, dk, dv, cols):
        _delta_level_scan_fwd[(triton.cdiv(dv, bv), lay.n * h, groups)](
            q_eff, w_wy, kd, *(scales or (dummy,) * 4), decay, zcols, v, lam, wts if wts is not None else lam,
            r0 if r0 is not None else dummy, out if reads else dummy, rfin if reads else dummy,
            rs if states else dummy, lay.seq_chunks, nl, nw, rows, ns, j0,
            K=dk, V=dv, C=CHUNK, BK=pow2(dk), BV=bv, S=s, H=h, MODE=mode, HAS_R0=r0 is not None,
            STORE_FINAL=reads, STORE_STATES=states, READS=reads, PREC=dot_precision(in_dtype),
            SCALED=scales is not None, num_warps=scan_warps(pow2(dk), s * bv), num_stages=1)
    return out, rfin, rs
