"""Triton kernels of SPEC §3's chunked second-order algorithm (backend "fused" of hla2, and of ahla).

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
inputs, tf32 for fp16/bf16). Chunk tables come from kernels.common.varlen (no host sync) and T is not
specialised on, so a new T never recompiles. Every kernel loops over or grids K and V in blocks (of <= 128 by
default), so any head dim up to SPEC §2's 256 works.
"""

import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from kernels.common.compile import dense_outputs
from kernels.common.env_options import parse_flag
from kernels.linear_attn.triton_bwd import _segment_reverse_cumsum
from kernels.linear_attn.triton_fwd import BT, Layout, _chunk_bounds, _pow2, _seq_bounds

from .state import STATE_TYPES, decay_powers, split_normalized, with_ones

# HILO_HLA="lowp=1": 16-bit inputs multiply bf16 operands (fp32 accumulation) instead of tf32 products of fp32 tiles:
# K~, V~ and the chunk states are rounded to bf16 at each product (as linear_attn's bf16 chunk states are).
# lowp_scan / lowp_out / lowp_dvalues / lowp_dqk do the same in one kernel family only (the state scans, the
# chunk outputs, the value gradients, the query / key gradients with the gate's partial): lowp=1 is all four.
# HILO_HLA="fp16=1": 16-bit inputs multiply fp16 operands scaled by powers of two (each row of the left operand and
# each column of the right one to a largest magnitude in [2^14, 2^15), the product rescaled in fp32) instead of tf32
# products of fp32 tiles. fp16 and tf32 both keep 11 significant bits, and the conversion rounds to nearest where
# the tensor cores' tf32 path truncates, so the products are as exact as tf32's at the 16-bit tensor-core rate; the
# exact power-of-two scales keep fp16's narrow exponent range out of the way (a row's entries below 2^-24 of its
# largest lose bits, which sums at that scale cannot notice). A family's lowp_* flag (bf16) wins over it. Off: on the
# H200 it was more accurate than tf32 (hla2 o 1.67e-3 against 2.02e-3 at K = 32, V = 64) but slower (hla2 fwd+bwd
# 12.3 ms against 10.5 at 16K x 2, H = 16, D = 128; session 11): these kernels are not bound by their dot rate.
# HILO_HLA="states16=1": 16-bit inputs store the per-chunk states (and their gradients) as fp16 with a power-of-two
# scale per state row and scan column block (_pow2_scales: the row's largest magnitude in [2^14, 2^15)) instead of
# fp32, half the bytes the scans write and the chunk kernels read. The chunk kernels only use those states as tf32
# dot operands, which keep the same 11 significant bits (truncated where fp16 rounds to nearest); the scans carry
# the running state in fp32 registers either way, so nothing compounds. fp32 inputs keep fp32 states.
# HILO_HLA="mid16=1": 16-bit inputs store the inner pass's output (hla2's K~, ahla's V~) as fp16 with a power-of-two
# scale per token and output column block, as states16 does the states: the outer pass reads it only as tf32 dot
# operands (and hla2's gate partial once, elementwise), which keep the same 11 bits.
# Both off: on the H200 (hla2 at 16K x 2, H = 16, D = 128, bf16 fwd+bwd, session 13) states16 took 8.88 ms and
# states16 + mid16 13.47 against 7.52 without: the scale passes cost more than the bytes they save.
# HILO_HLA="compose16=0|1" is not this module's: whether the "triton" backend's compositions (kernels/hla/compose.py)
# run their linear_attn passes in bf16 for bf16 inputs (unset: hla2 and hla3 do, and take that backend by default).
# HILO_HLA="one_op=0|1" is not this module's either: hla2's and hla3's passes as one op whose backward accumulates
# q's and k's gradients inside the kernels (kernels/hla/compose_op.py; on by default since session 17; 0: separate
# passes).
OPTIONS = {"lowp": False, "lowp_scan": False, "lowp_out": False, "lowp_dvalues": False, "lowp_dqk": False,
           "fp16": False, "states16": False, "mid16": False, "compose16": None, "one_op": True}
# Launch configuration of each kernel family (HILO_HLA="out_warps=4,out_stages=3,dqk_bv=64", ...; 0 keeps the
# default of LAUNCH_DEFAULTS): num_warps ("<family>_warps"), num_stages ("<family>_stages") and the tiles the
# family's loops step by ("scan_by": the scans' state columns, capped at 64 and halved to 32 on small grids by
# default; "out_by" / "dvalues_bv": the chunk kernels' output columns; "dqk_bv": _pass_dqk's V loop; "<f>_bk": the
# K loop of out, dvalues and dqk). Tiles are powers of two in 16..128. "<family>_maxnreg" caps registers a thread
# (ptxas' .maxnreg; 0: no cap). "out_persist" / "dvalues_persist" (1: off): each program of _chunk_out /
# _pass_dvalues takes that many chunks in a loop pipelined over <family>_stages stages, so the next chunk's tiles load
# while this one's products run (with 128-wide K loops a chunk is one load-then-compute step, which only other
# resident programs overlap; for session 13's sweep). Session 12's sweeps on the H200 (bf16 fwd+bwd, RESULTS.md):
# the chunk kernels at 4 warps with 128-wide K loops, hla2 7.57 ms against 10.50 (8 warps, 64-wide) at 16K x 2,
# H = 16, D = 128, ahla 7.07 against 11.08, hla2 at hla_mamba2's heads (8K x 4, H = 32, K = 128, V = 64) 12.18
# against 17.20; a 128-register cap, 3 stages, wider output tiles or dqk_bv=64 on top of that were slower, and the
# scans' settings did not pay. Session 13: _pass_dqk's K loop 64 wide (dqk_bk; at 128 it spilled 744-848 B a thread,
# AOT), hla2 7.10 ms against 7.52, at hla_mamba2's heads 11.38 against 12.14 (ahla not yet timed with it).
LAUNCH_DEFAULTS = {"scan_warps": 4, "scan_stages": 2, "scan_by": 0, "scan_maxnreg": 0,
                   "out_warps": 4, "out_stages": 2, "out_bk": 128, "out_by": 64, "out_maxnreg": 0, "out_persist": 1,
                   "dvalues_warps": 4, "dvalues_stages": 2, "dvalues_bk": 128, "dvalues_bv": 64, "dvalues_maxnreg": 0,
                   "dvalues_persist": 1,
                   "dqk_warps": 4, "dqk_stages": 2, "dqk_bk": 64, "dqk_bv": 32,  # dqk_bv: 32 even at V = 16
                   "dqk_maxnreg": 0}
OPTIONS.update(dict.fromkeys(LAUNCH_DEFAULTS, 0))
_TILES = ("scan_by", "out_bk", "out_by", "dvalues_bk", "dvalues_bv", "dqk_bk", "dqk_bv")


def _read_options() -> None:
    for item in filter(None, (x.strip() for x in os.environ.get("HILO_HLA", "").split(","))):
        key, _, val = (part.strip() for part in item.partition("="))
        if key not in OPTIONS:
            raise ValueError(f"HILO_HLA: unknown option {key!r}; expected one of {sorted(OPTIONS)}")
        if key not in LAUNCH_DEFAULTS:
            OPTIONS[key] = parse_flag("HILO_HLA", key, val)
            continue
        kind = ("tile" if key in _TILES else key.rpartition("_")[2])
        allowed = {"tile": ((16, 32, 64, 128), "a tile of 16, 32, 64 or 128"),
                   "warps": ((1, 2, 4, 8, 16), "1, 2, 4, 8 or 16 warps"),
                   "stages": (range(1, 6), "1 to 5 stages"),
                   "maxnreg": (range(64, 256, 8), "a register cap, a multiple of 8 in 64..248"),
                   "persist": ((1, 2, 4, 8, 16), "1, 2, 4, 8 or 16 chunks a program")}[kind]
        if not (val.isdigit() and (int(val) == 0 or int(val) in allowed[0])):
            raise ValueError(f"HILO_HLA: {key}={val!r}: expected 0 (the default) or {allowed[1]}")
        OPTIONS[key] = int(val)


# The chunk kernels' output columns where K > 128 (the HLA Gated DeltaNet's K = 256, ahla in value blocks of 256):
# 32 instead of LAUNCH_DEFAULTS' 64. H200, bf16, ahla fwd+bwd at the HLA Gated DeltaNet's heads (8K x 4, H = 3, K = V =
# 256): 4.838 ms against 5.483 (64-wide K loops 5.209, 8 warps 5.216); hla_gated_deltanet 340m compiled at 8K x 4:
# 79,645 tokens/s against 74,284 (s19_c.sh, s19_e.sh, s19_f.sh). sm_90 AOT: 255 registers and 64-80 B of spills a
# thread at 64 columns, one program a multiprocessor. K <= 128 keeps 64 (session 12's sweeps).
WIDE_K_COLS = {"out_by": 32, "dvalues_bv": 32}


def _launch(key: str, dk: int = 0) -> int:
    """The launch setting `key` of LAUNCH_DEFAULTS: OPTIONS' unless 0; dk: the pass's K (WIDE_K_COLS above 128)."""
    if OPTIONS.get(key):
        return int(OPTIONS[key])
    return WIDE_K_COLS[key] if dk > 128 and key in WIDE_K_COLS else LAUNCH_DEFAULTS[key]


def _launch_kwargs(family: str) -> dict:
    """num_warps, num_stages and (when capped) maxnreg of one kernel family's launches."""
    out = {"num_warps": _launch(family + "_warps"), "num_stages": _launch(family + "_stages")}
    if _launch(family + "_maxnreg"):
        out["maxnreg"] = _launch(family + "_maxnreg")
    return out


_read_options()


def _precision(q: torch.Tensor, kernel: str) -> str:
    """The dots' precision of one kernel family ("scan", "out", "dvalues", "dqk") for inputs of q's dtype (fp32
    intermediates such as K~ do not change it): "ieee" for fp32, "tf32" for 16-bit inputs ("fp16", scaled fp16
    operands, with OPTIONS["fp16"]), or "bf16" (operands rounded to bf16) with OPTIONS["lowp"] or the family's own
    OPTIONS["lowp_" + kernel]."""
    if q.dtype == torch.float32:
        return "ieee"
    if not (OPTIONS["lowp"] or OPTIONS["lowp_" + kernel]):
        return "fp16" if OPTIONS["fp16"] else "tf32"
    # the interpreter computes tl.dot on bf16 operands wrongly (SPEC §10): there the operands are rounded to bf16 and
    # multiplied in fp32 instead, the same values up to the order of the fp32 sums, so CPU tests reach this path
    return "bf16_rounded" if os.environ.get("TRITON_INTERPRET") == "1" else "bf16"


@triton.jit
def _pow2_scales(m):
    """(s, 1 / s) for magnitudes m >= 0: exact powers of two with m / s in [2^14, 2^15), below fp16's largest
    65504; s is clamped to 2^-126 .. 2^126, so zero or subnormal m keeps zero rows zero and inf / nan stay so."""
    e = (m.to(tl.int32, bitcast=True) >> 23) & 0xFF  # the biased exponent: m in [2^(e - 127), 2^(e - 126))
    k = tl.minimum(tl.maximum(e - 141, -126), 126)
    return ((127 + k) << 23).to(tl.float32, bitcast=True), ((127 - k) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """a @ b accumulated in fp32: bf16 operands for PREC "bf16" (or "bf16_rounded": rounded to bf16, multiplied in
    fp32, for the interpreter), fp16 operands scaled per row of a and per column of b for "fp16" (OPTIONS), else
    fp32 operands at input_precision PREC."""
    if PREC == "bf16":  # if / else, not an early return: the code after a return would still be compiled
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == "fp16":
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        s_a, inv_a = _pow2_scales(tl.max(tl.abs(a), 1))
        s_b, inv_b = _pow2_scales(tl.max(tl.abs(b), 0))
        out = tl.dot((a * inv_a[:, None]).to(tl.float16), (b * inv_b[None, :]).to(tl.float16))
        out = out * s_a[:, None] * s_b[None, :]  # in this order: s_a * s_b alone could leave fp32's range
    elif PREC == "bf16_rounded":
        out = tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
    return out


@triton.jit
def _load_state(hs, hs_scale, base, o_row, o_col, mask, DY: tl.constexpr, SBY: tl.constexpr, STATE16: tl.constexpr):
    """The fp32 tile of a per-chunk state at rows o_row (its DX index) and columns o_col (its DY index), any
    broadcastable pair of index tiles (a transposed tile passes them transposed); base: the (chunk, head) offset in
    elements of the state (DX * DY per chunk and head). STATE16: fp16 values times the scale of their row and
    SBY-column block (hs_scale [rows, H, DX, cdiv(DY, SBY)], based at base // DY * cdiv(DY, SBY))."""
    x = tl.load(hs + base + o_row * DY + o_col, mask=mask, other=0.0)
    if STATE16:
        ny: tl.constexpr = (DY + SBY - 1) // SBY
        x = x.to(tl.float32) * tl.load(hs_scale + base // DY * ny + o_row * ny + o_col // SBY, mask=mask, other=0.0)
    return x


@triton.jit(do_not_specialize=["T", "NT"])
def _state_scan(x, y, g, h0, hs, hs_scale, ht, bounds, offsets, x_scale, mid_scale, T, NT,
                H: tl.constexpr, DX: tl.constexpr, DY: tl.constexpr, BT: tl.constexpr, BX: tl.constexpr,
                BY: tl.constexpr, POWER: tl.constexpr, REVERSE: tl.constexpr, HAS_G: tl.constexpr,
                HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
                STATE16: tl.constexpr, MID: tl.constexpr, SBM: tl.constexpr):
    """Forward: hs[c] = state entering chunk c, state <- e^{p l_C} state + (x e^{p (l_C - l)})^T y.
    REVERSE: hs[c] = gradient of the state leaving chunk c, state <- e^{p l_C} state + (x_scale x e^{p l})^T y.
    x [TT, H, DX], y [TT, H, DY]; h0 / ht [N, H, DX, DY] (initial and last value), hs [rows, H, DX, DY] fp32, or
    with STATE16 fp16 times hs_scale [rows, H, DX, cdiv(DY, BY)] (a power of two per row and BY-column block).
    MID 1 / 2: x / y is a mid16 token tensor (fp16 times mid_scale [TT, H, cdiv(D, SBM)]); 0: neither."""
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
        if STATE16:
            s_row, inv_row = _pow2_scales(tl.max(tl.abs(state), 1))
            tl.store(hs + ((c0 + c) * H + i_h) * DX * DY + xy_off, (state * inv_row[:, None]).to(tl.float16),
                     mask=m_xy)
            tl.store(hs_scale + ((c0 + c) * H + i_h) * DX * tl.cdiv(DY, BY) + o_x * tl.cdiv(DY, BY) + i_y, s_row,
                     mask=o_x < DX)
        else:
            tl.store(hs + ((c0 + c) * H + i_h) * DX * DY + xy_off, state, mask=m_xy)
        o_t = bos + c * BT + tl.arange(0, BT)
        m_t = o_t < eos
        xb = _load_tok(x, mid_scale, o_t[:, None], i_h, o_x[None, :], m_t[:, None] & (o_x[None, :] < DX), H, DX,
                       SBM, MID == 1).to(tl.float32)
        yb = _load_tok(y, mid_scale, o_t[:, None], i_h, o_y[None, :], m_t[:, None] & (o_y[None, :] < DY), H, DY,
                       SBM, MID == 2).to(tl.float32)
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
def _load_tok(ptr, sptr, o_row, i_h, o_col, mask, H: tl.constexpr, D: tl.constexpr, SB: tl.constexpr,
              SCALED: tl.constexpr):
    """A tile of a token tensor [TT, H, D] at tokens o_row and columns o_col (broadcastable index tiles, either
    orientation), as stored (SCALED False) or as fp32 from fp16 values times the scale of their token and SB-column
    block (sptr [TT, H, cdiv(D, SB)], mid16)."""
    x = tl.load(ptr + (o_row * H + i_h) * D + o_col, mask=mask, other=0.0)
    if SCALED:
        nb: tl.constexpr = (D + SB - 1) // SB
        x = x.to(tl.float32) * tl.load(sptr + (o_row * H + i_h) * nb + o_col // SB, mask=mask, other=0.0)
    return x


@triton.jit
def _persistent_chunk(table, i_p, j, ROWS, T, NT, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(chunk, start, end) of a persistent program's j-th chunk: program i_p of the grid's chunk axis takes chunks
    i_p, i_p + P, i_p + 2P, ... (P programs on that axis, so the programs running together read neighbouring chunks);
    past the last chunk, the last chunk with end = start (every load and store masked off)."""
    i_c = i_p + j * tl.num_programs(1)
    start, end = _chunk_bounds(table, tl.minimum(i_c, ROWS - 1), T, NT, BT, IS_VARLEN)
    return tl.minimum(i_c, ROWS - 1), start, tl.where(i_c < ROWS, end, start)


@triton.jit(do_not_specialize=["T", "NT", "ROWS"])
def _chunk_out(q, x, y, g, hs, hs_scale, o, mid_scale, table, scale, T, NT, ROWS,
               H: tl.constexpr, K: tl.constexpr, DY: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               BY: tl.constexpr, POWER: tl.constexpr, HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr,
               PREC: tl.constexpr, SBY: tl.constexpr, STATE16: tl.constexpr, PERSIST: tl.constexpr,
               STAGES: tl.constexpr, MID: tl.constexpr, SBM: tl.constexpr):
    """o = scale (e^{p l} (q hs_in) + (Gamma^(p) * q x^T) y) for one (DY-block, chunk, head), or with PERSIST > 1
    for PERSIST chunks in a loop of STAGES pipelining stages (the next chunk's tiles load during this one's products):
    q, x [TT, H, K], y [TT, H, DY], hs [rows, H, K, DY] (the state entering each chunk). MID 1 / 2: x / y is a
    mid16 token tensor with mid_scale; 3: o is stored as one (fp16, a scale per token and BY-block, SBM = BY)."""
    i_y, i_p, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if PERSIST == 1:
        start, end = _chunk_bounds(table, i_p, T, NT, BT, IS_VARLEN)
        if start < end:
            _chunk_out_tile(q, x, y, g, hs, hs_scale, o, mid_scale, scale, i_y, i_p, i_h, start, end, H, K, DY, BT,
                            BK, BY, POWER, HAS_G, PREC, SBY, STATE16, PERSIST, MID, SBM)
    else:
        for j in tl.range(0, PERSIST, num_stages=STAGES):
            i_c, start, end = _persistent_chunk(table, i_p, j, ROWS, T, NT, BT, IS_VARLEN)
            _chunk_out_tile(q, x, y, g, hs, hs_scale, o, mid_scale, scale, i_y, i_c, i_h, start, end, H, K, DY, BT,
                            BK, BY, POWER, HAS_G, PREC, SBY, STATE16, PERSIST, MID, SBM)


@triton.jit
def _chunk_out_tile(q, x, y, g, hs, hs_scale, o, mid_scale, scale, i_y, i_c, i_h, start, end,
                    H: tl.constexpr, K: tl.constexpr, DY: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                    BY: tl.constexpr, POWER: tl.constexpr, HAS_G: tl.constexpr, PREC: tl.constexpr,
                    SBY: tl.constexpr, STATE16: tl.constexpr, PERSIST: tl.constexpr, MID: tl.constexpr,
                    SBM: tl.constexpr):
    """_chunk_out's work for chunk i_c = tokens [start, end) (none when end == start: everything masked)."""
    o_t = start + tl.arange(0, BT)
    m_t = o_t < end
    o_y = i_y * BY + tl.arange(0, BY)
    acc = tl.zeros([BT, BY], dtype=tl.float32)
    scores = tl.zeros([BT, BT], dtype=tl.float32)
    if PERSIST > 1:  # a persistent program's extra turn is an empty chunk: it reads no state
        k_rows = tl.where(start < end, K, 0)
    else:
        k_rows = K
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k[None, :] < K)
        qb = tl.load(q + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        xb = _load_tok(x, mid_scale, o_t[:, None], i_h, o_k[None, :], m_tk, H, K, SBM, MID == 1).to(tl.float32)
        hb = _load_state(hs, hs_scale, (i_c.to(tl.int64) * H + i_h) * K * DY, o_k[:, None], o_y[None, :],
                         (o_k[:, None] < k_rows) & (o_y[None, :] < DY), DY, SBY, STATE16)
        acc += _dot(qb, hb, PREC)
        scores += _dot(qb, tl.trans(xb), PREC)
    o_i = tl.arange(0, BT)
    causal = o_i[:, None] >= o_i[None, :]
    if HAS_G:
        gc = tl.cumsum(tl.load(g + o_t * H + i_h, mask=m_t, other=0.0).to(tl.float32) * POWER, 0)
        acc *= tl.exp(gc)[:, None]
        scores *= tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
    scores = tl.where(causal, scores, 0.0)
    yb = _load_tok(y, mid_scale, o_t[:, None], i_h, o_y[None, :], m_t[:, None] & (o_y[None, :] < DY), H, DY, SBM,
                   MID == 2).to(tl.float32)
    acc += _dot(scores, yb, PREC)
    acc *= scale
    if MID == 3:  # one scale per token over this program's BY columns
        s_row, inv_row = _pow2_scales(tl.max(tl.abs(acc), 1))
        acc *= inv_row[:, None]
        tl.store(mid_scale + (o_t * H + i_h) * tl.cdiv(DY, BY) + i_y, s_row, mask=m_t)
    tl.store(o + (o_t[:, None] * H + i_h) * DY + o_y[None, :], acc.to(o.dtype.element_ty),
             mask=m_t[:, None] & (o_y[None, :] < DY))


@triton.jit(do_not_specialize=["T", "NT", "ROWS"])
def _pass_dvalues(q, x, do, g, dhs, dhs_scale, dy, mid_scale, table, scale, T, NT, ROWS,
                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, POWER: tl.constexpr, HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr,
                  PREC: tl.constexpr, SBY: tl.constexpr, STATE16: tl.constexpr, PERSIST: tl.constexpr,
                  STAGES: tl.constexpr, MID: tl.constexpr, SBM: tl.constexpr):
    """dY of one pass O = LA(Q^, X, Y; p g) for one (V-block, chunk, head), given dO and dS_out (the gradient of
    the state leaving each chunk, dhs [rows, H, K, V] fp32):  dy = e^{p (l_C - l)} (X dS_out) + (Gamma * Q^ X^T)^T dO.
    q, x [TT, H, K], do, dy [TT, H, V]. PERSIST > 1: PERSIST chunks a program, as _chunk_out. MID 1: x is a mid16
    token tensor with mid_scale."""
    i_v, i_p, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if PERSIST == 1:
        start, end = _chunk_bounds(table, i_p, T, NT, BT, IS_VARLEN)
        if start < end:
            _pass_dvalues_tile(q, x, do, g, dhs, dhs_scale, dy, mid_scale, scale, i_v, i_p, i_h, start, end, H, K, V,
                               BT, BK, BV, POWER, HAS_G, PREC, SBY, STATE16, PERSIST, MID, SBM)
    else:
        for j in tl.range(0, PERSIST, num_stages=STAGES):
            i_c, start, end = _persistent_chunk(table, i_p, j, ROWS, T, NT, BT, IS_VARLEN)
            _pass_dvalues_tile(q, x, do, g, dhs, dhs_scale, dy, mid_scale, scale, i_v, i_c, i_h, start, end, H, K, V,
                               BT, BK, BV, POWER, HAS_G, PREC, SBY, STATE16, PERSIST, MID, SBM)


@triton.jit
def _pass_dvalues_tile(q, x, do, g, dhs, dhs_scale, dy, mid_scale, scale, i_v, i_c, i_h, start, end,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, POWER: tl.constexpr, HAS_G: tl.constexpr, PREC: tl.constexpr,
                       SBY: tl.constexpr, STATE16: tl.constexpr, PERSIST: tl.constexpr, MID: tl.constexpr,
                       SBM: tl.constexpr):
    """_pass_dvalues' work for chunk i_c = tokens [start, end) (none when end == start)."""
    o_t = start + tl.arange(0, BT)
    m_t = o_t < end
    o_v = i_v * BV + tl.arange(0, BV)
    m_tv = m_t[:, None] & (o_v[None, :] < V)
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    scores_t = tl.zeros([BT, BT], dtype=tl.float32)  # [j, i] = x_j . q^_i
    if PERSIST > 1:  # a persistent program's extra turn is an empty chunk: it reads no state
        k_rows = tl.where(start < end, K, 0)
    else:
        k_rows = K
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k[None, :] < K)
        xb = _load_tok(x, mid_scale, o_t[:, None], i_h, o_k[None, :], m_tk, H, K, SBM, MID == 1).to(tl.float32)
        q_t = tl.load(q + (o_t[None, :] * H + i_h) * K + o_k[:, None], mask=m_tk.T, other=0.0).to(tl.float32)
        dsb = _load_state(dhs, dhs_scale, (i_c.to(tl.int64) * H + i_h) * K * V, o_k[:, None], o_v[None, :],
                          (o_k[:, None] < k_rows) & (o_v[None, :] < V), V, SBY, STATE16)
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
def _pass_dqk(q, x, y, g, do, hs, hs_scale, dhs, dhs_scale, dq_prev, dx_prev, dq, dx, r_parts, mid_scale, table,
              scale, T, NT, TT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
              BK: tl.constexpr, BV: tl.constexpr, POWER: tl.constexpr, HAS_G: tl.constexpr, HAS_PREV: tl.constexpr,
              IS_VARLEN: tl.constexpr, PREC: tl.constexpr, SBY: tl.constexpr, STATE16: tl.constexpr,
              MID: tl.constexpr, SBM: tl.constexpr):
    """dq, dX (X as keys) and the gate partial p (q^.dq^ - x.dx) of one pass O = LA(Q^, X, Y; p g) for one
    (K-block, chunk, head), given dO; with HAS_PREV, dq_prev and dx_prev are added (a later pass's partials, or
    X's gradient from its other role). With dA = Gamma * (dO Y^T):
        dq^ = e^{p l} (dO S_in^T) + dA X,     dx = e^{p (l_C - l)} (Y dS_out^T) + dA^T Q^.
    hs / dhs [rows, H, K, V] fp32: the state entering and the gradient of the state leaving each chunk; the gate
    partial of K-block i goes to r_parts[i] [TT, H]. MID 1 / 2: x / y is a mid16 token tensor with mid_scale."""
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
        yb = _load_tok(y, mid_scale, o_t[:, None], i_h, o_v[None, :], m_tv, H, V, SBM, MID == 2).to(tl.float32)
        y_t = _load_tok(y, mid_scale, o_t[None, :], i_h, o_v[:, None], m_tv.T, H, V, SBM, MID == 2).to(tl.float32)
        # states as [BV, BK] tiles (transposed addressing)
        m_vk = (o_v[:, None] < V) & (o_k[None, :] < K)
        sb_t = _load_state(hs, hs_scale, state_base, o_k[None, :], o_v[:, None], m_vk, V, SBY, STATE16)
        dsb_t = _load_state(dhs, dhs_scale, state_base, o_k[None, :], o_v[:, None], m_vk, V, SBY, STATE16)
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
    xb = _load_tok(x, mid_scale, o_t[:, None], i_h, o_k[None, :], m_tk, H, K, SBM, MID == 1).to(tl.float32)
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
    """Tiles of the sequential scans: 64 x 64, or 64 x 32 when that leaves the GPU under-filled (scan_by sets the
    columns)."""
    bx, by = _pow2(dx, hi=64), _pow2(dy, hi=64)
    if OPTIONS["scan_by"]:
        return bx, _pow2(dy, hi=OPTIONS["scan_by"])
    if programs * triton.cdiv(dx, bx) * triton.cdiv(dy, by) < 256 and by > 32:
        by = 32
    return bx, by


class ChunkStates(NamedTuple):
    """The per-chunk states of one scan: values [rows, H, DX, DY], fp32, or fp16 times scales [rows, H, DX,
    cdiv(DY, by)] (states16; scales None otherwise), by: the scan's column block."""
    values: torch.Tensor
    scales: Optional[torch.Tensor]  # noqa: UP045
    by: int

    def kernel_args(self) -> tuple:
        """(values, scales or a placeholder) for a kernel's (hs, hs_scale) arguments."""
        return self.values, (self.scales if self.scales is not None else self.values)

    def kernel_consts(self) -> dict:
        """SBY (unused for fp32 states: a fixed 16, so fp32 builds do not vary with the scans' blocks) and STATE16."""
        half = self.scales is not None
        return {"SBY": self.by if half else 16, "STATE16": half}


class MidTokens(NamedTuple):
    """The inner pass's output (hla2's K~, ahla's V~): values [TT, H, D], fp32, or fp16 times scales [TT, H,
    cdiv(D, sb)] (mid16; scales None otherwise), sb: the producing _chunk_out's column block."""
    values: torch.Tensor
    scales: Optional[torch.Tensor]  # noqa: UP045
    sb: int


def _mid_args(mid: Optional[MidTokens], role: int, placeholder: torch.Tensor) -> tuple:  # noqa: UP045
    """(mid_scale argument, {"MID", "SBM"}) of a launch in which `mid` plays `role` (1: x, 2: y; 0 or an fp32 mid:
    an ordinary launch)."""
    if mid is None or mid.scales is None or role == 0:
        return placeholder, {"MID": 0, "SBM": 16}
    return mid.scales, {"MID": role, "SBM": mid.sb}


def _mid16(q: torch.Tensor) -> bool:
    """Whether inputs of q's dtype store the inner pass's output as scaled fp16 (OPTIONS["mid16"]; 16-bit only)."""
    return bool(OPTIONS["mid16"]) and q.dtype != torch.float32


def _block_from_shapes(d: int, nb: int) -> int:
    """The column block (a power of two >= 16) that split d columns into nb scale columns: next_pow2(ceil(d / nb))
    maps every column to the same block as the producer's did (see test_states16_column_block_from_shapes)."""
    return max(16, triton.next_power_of_2(triton.cdiv(d, nb)))


def _states16(q: torch.Tensor) -> bool:
    """Whether inputs of q's dtype store their per-chunk states as scaled fp16 (OPTIONS["states16"]; 16-bit only)."""
    return bool(OPTIONS["states16"]) and q.dtype != torch.float32


def _states_from(values: torch.Tensor, scales: torch.Tensor) -> ChunkStates:
    """ChunkStates from a custom op's tensors: scales empty for fp32 values; the column block follows from the
    shapes (by is a power of two >= 16 and the scales have cdiv(DY, by) columns, so by = next_pow2(ceil(DY / ny)))."""
    if scales.numel() == 0:
        return ChunkStates(values, None, 16)
    return ChunkStates(values, scales, _block_from_shapes(values.shape[-1], scales.shape[-1]))


def _scan(x, y, g, power, h0, lay: Layout, reverse: bool, x_scale: float, store_last: bool, prec: str,
          half: bool = False, mid: Optional[MidTokens] = None, role: int = 0):  # noqa: UP045
    """Per-chunk states (ChunkStates: fp32, or scaled fp16 with `half`) and the last state [N, H, DX, DY] fp32 (or
    None); mid (role 1: it is x, 2: y) a mid16 MidTokens read as such."""
    dx, dy = x.shape[-1], y.shape[-1]
    h = lay.heads
    bx, by = _scan_blocks(dx, dy, lay.n * h)
    hs = torch.empty(lay.rows, h, dx, dy, device=x.device, dtype=torch.float16 if half else torch.float32)
    scales = torch.empty(lay.rows, h, dx, triton.cdiv(dy, by), device=x.device, dtype=torch.float32) if half else None
    ht = torch.empty(lay.n, h, dx, dy, device=x.device, dtype=torch.float32) if store_last else None
    grid = (triton.cdiv(dx, bx) * triton.cdiv(dy, by), lay.n * h)
    mid_scale, mid_consts = _mid_args(mid, role, x)
    _state_scan[grid](x, y, g if g is not None else x, h0 if h0 is not None else hs, hs,
                      scales if half else hs, ht if ht is not None else hs, lay.bounds, lay.offsets, x_scale,
                      mid_scale, lay.seqlen, lay.nt, H=h, DX=dx, DY=dy, BT=BT, BX=bx, BY=by, POWER=power,
                      REVERSE=reverse, HAS_G=g is not None, HAS_H0=h0 is not None, STORE_HT=store_last,
                      IS_VARLEN=lay.varlen, PREC=prec, STATE16=half, **mid_consts, **_launch_kwargs("scan"))
    return ChunkStates(hs, scales, by), ht


def _out(q, x, y, g, power, hs: ChunkStates, scale, lay: Layout, out_dtype, prec,
         mid: Optional[MidTokens] = None, role: int = 0, store_mid16: bool = False):  # noqa: UP045
    """The chunk outputs of one pass [TT, H, DY] in out_dtype; mid (role 1: it is x, 2: y) a mid16 MidTokens read as
    such; store_mid16: the output is the inner pass's, stored as scaled fp16 (returned as MidTokens)."""
    dk, dy = q.shape[-1], y.shape[-1]
    by = _pow2(dy, hi=_launch("out_by", dk))
    o = torch.empty(*y.shape, device=y.device, dtype=torch.float16 if store_mid16 else out_dtype)
    if store_mid16:
        produced = MidTokens(o, torch.empty(*y.shape[:-1], triton.cdiv(dy, by), device=y.device,
                                            dtype=torch.float32), by)
        mid_scale, mid_consts = produced.scales, {"MID": 3, "SBM": by}
    else:
        mid_scale, mid_consts = _mid_args(mid, role, x)
    persist = _launch("out_persist")
    grid = (triton.cdiv(dy, by), triton.cdiv(lay.rows, persist), lay.heads)
    _chunk_out[grid](q, x, y, g if g is not None else q, *hs.kernel_args(), o, mid_scale, lay.table, scale,
                     lay.seqlen, lay.nt, lay.rows, H=lay.heads, K=dk, DY=dy, BT=BT,
                     BK=_pow2(dk, hi=_launch("out_bk")), BY=by, POWER=power, HAS_G=g is not None,
                     IS_VARLEN=lay.varlen, PREC=prec, **hs.kernel_consts(), PERSIST=persist,
                     STAGES=_launch("out_stages"), **mid_consts, **_launch_kwargs("out"))
    return produced if store_mid16 else o


def _pass_grads(q, x, y, g, do, hs: ChunkStates, dhs: ChunkStates, power, scale, lay: Layout, dtypes, prev=None,
                dy=None, mid: Optional[MidTokens] = None, role: int = 0):  # noqa: UP045
    """(dq, dx, dy, gate partial or None) of one pass O = LA(Q^, X, Y; p g), in dtypes (dq, dx, dy); prev: the
    (dq, dx, gate partial) to add (a later pass's, or X's gradient from its other role); dy: a buffer for dY;
    mid (role 1: it is X, 2: Y) a mid16 MidTokens read as such."""
    dk, dv = q.shape[-1], y.shape[-1]
    h = lay.heads
    gate = g if g is not None else q
    dy = torch.empty(y.shape, device=q.device, dtype=dtypes[2]) if dy is None else dy
    bk, bv = _pow2(dk, hi=_launch("dvalues_bk")), _pow2(dv, hi=_launch("dvalues_bv", dk))
    persist = _launch("dvalues_persist")
    mid_scale, mid_consts = _mid_args(mid, role if role == 1 else 0, x)  # _pass_dvalues reads no Y
    _pass_dvalues[(triton.cdiv(dv, bv), triton.cdiv(lay.rows, persist), h)](
        q, x, do, gate, *dhs.kernel_args(), dy, mid_scale, lay.table, scale, lay.seqlen, lay.nt, lay.rows, H=h, K=dk,
        V=dv, BT=BT, BK=bk, BV=bv, POWER=power, HAS_G=g is not None, IS_VARLEN=lay.varlen,
        PREC=_precision(q, "dvalues"), **dhs.kernel_consts(), PERSIST=persist, STAGES=_launch("dvalues_stages"),
        **mid_consts, **_launch_kwargs("dvalues"))
    dq, dx = (torch.empty(t.shape, device=q.device, dtype=d) for t, d in zip((q, x), dtypes[:2], strict=True))
    bk = _pow2(dk, hi=_launch("dqk_bk"))
    bv = _pow2(dv, hi=OPTIONS["dqk_bv"]) if OPTIONS["dqk_bv"] else 32
    nk = triton.cdiv(dk, bk)
    r_parts = torch.empty(nk, lay.total, h, device=q.device, dtype=torch.float32) if g is not None else None
    dq_prev, dx_prev, r_prev = prev if prev is not None else (dq, dx, None)
    # the forward and the backward scans of one pass have the same (DX, DY) and programs, hence the same blocks
    assert hs.kernel_consts() == dhs.kernel_consts(), (hs.kernel_consts(), dhs.kernel_consts())
    mid_scale, mid_consts = _mid_args(mid, role, x)
    _pass_dqk[(nk, lay.rows, h)](q, x, y, gate, do, *hs.kernel_args(), *dhs.kernel_args(), dq_prev, dx_prev, dq, dx,
                                 r_parts if r_parts is not None else dq, mid_scale, lay.table, scale, lay.seqlen,
                                 lay.nt, lay.total, H=h, K=dk, V=dv, BT=BT, BK=bk, BV=bv,
                                 POWER=power, HAS_G=g is not None, HAS_PREV=prev is not None,
                                 IS_VARLEN=lay.varlen, PREC=_precision(q, "dqk"), **hs.kernel_consts(),
                                 **mid_consts, **_launch_kwargs("dqk"))
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
    (the inner pass's output K~ or V~ (MidTokens), the inner and outer ChunkStates), for the backward.
    hla2: K~ = LA(Q^, K, K; a g), O = LA(Q^, K~, V; b g);  ahla: V~ = LA(Q^, K, V; g), O = LA(Q^, K, V~; g)."""
    p_in, p_out = powers
    prec, prec_out = _precision(q, "scan"), _precision(q, "out")
    inner_value = k if op == "hla2" else v
    half = _states16(q)
    in_states, in_last = _scan(k, inner_value, g, p_in, h0[0], lay, False, 1.0, store_final, prec, half)
    mid = _out(q, k, inner_value, g, p_in, in_states, scale, lay, torch.float32, prec_out, store_mid16=_mid16(q))
    if not isinstance(mid, MidTokens):
        mid = MidTokens(mid, None, 16)
    role = 1 if op == "hla2" else 2  # K~ is the outer pass's key, V~ its value
    outer_key, outer_value = (mid.values, v) if op == "hla2" else (k, mid.values)
    out_states, out_last = _scan(outer_key, outer_value, g, p_out, h0[1], lay, False, 1.0, store_final, prec, half,
                                 mid=mid, role=role)
    o = _out(q, outer_key, outer_value, g, p_out, out_states, scale, lay, out_dtype, prec_out, mid=mid, role=role)
    return o, (in_last, out_last), (mid, in_states, out_states)


def fused_bwd(op, q, k, v, g, saved, finals, do, d_finals, scale, powers, lay: Layout, need_h0: bool):
    """Gradients (dq, dk, dv, dg or None, (d inner, d outer) initial states or None) on the packed layout."""
    p_in, p_out = powers
    mid, in_states, out_states = saved
    prec = _precision(q, "scan")
    half = in_states.scales is not None  # the gradient states as the forward's
    d_out_states, d_out_h0 = _scan(q, do, g, p_out, d_finals[1], lay, True, scale, need_h0, prec, half)
    f32 = torch.float32
    if op == "hla2":
        # outer pass: keys K~, values V;  then the inner pass K~ = LA(Q^, K, K), whose k is key and value: its
        # value gradient (written first) is added to its key gradient
        dq_outer, dmid, dv, r = _pass_grads(q, mid.values, v, g, do, out_states, d_out_states, p_out, scale, lay,
                                            (f32, f32, v.dtype), mid=mid, role=1)
        d_in_states, d_in_h0 = _scan(q, dmid, g, p_in, d_finals[0], lay, True, scale, need_h0, prec, half)
        dk_as_value = torch.empty(k.shape, device=k.device, dtype=f32)
        dq, dk, _, r_all = _pass_grads(q, k, k, g, dmid, in_states, d_in_states, p_in, scale, lay,
                                       (q.dtype, k.dtype, f32), prev=(dq_outer, dk_as_value, r), dy=dk_as_value)
    else:
        # outer pass: keys K, values V~;  then the inner pass V~ = LA(Q^, K, V), adding the outer partials
        dq_outer, dk_outer, dmid, r = _pass_grads(q, k, mid.values, g, do, out_states, d_out_states, p_out, scale,
                                                  lay, (f32, f32, f32), mid=mid, role=2)
        d_in_states, d_in_h0 = _scan(q, dmid, g, p_in, d_finals[0], lay, True, scale, need_h0, prec, half)
        dq, dk, dv, r_all = _pass_grads(q, k, v, g, dmid, in_states, d_in_states, p_in, scale, lay,
                                        (q.dtype, k.dtype, v.dtype), prev=(dq_outer, dk_outer, r))
    dg = None
    if g is not None:
        dg = _segment_reverse_cumsum(_final_state_gate_terms(r_all, finals, d_finals, powers, lay), lay)
    return dq, dk, dv, dg, (d_in_h0, d_out_h0)


def _saved_tensors(saved) -> tuple:
    """fused_fwd's saved (MidTokens, inner ChunkStates, outer ChunkStates) as 6 tensors, each values and scales (no
    scales: an empty tensor)."""
    def scales(part):
        return part.scales if part.scales is not None else part.values.new_empty(0, dtype=torch.float32)

    return tuple(t for part in saved for t in (part.values, scales(part)))


def _saved_from(tensors) -> tuple:
    """The inverse of _saved_tensors (the column blocks follow from the shapes)."""
    mid, mid_scales, in_values, in_scales, out_values, out_scales = tensors
    mid = (MidTokens(mid, None, 16) if mid_scales.numel() == 0 else
           MidTokens(mid, mid_scales, _block_from_shapes(mid.shape[-1], mid_scales.shape[-1])))
    return mid, _states_from(in_values, in_scales), _states_from(out_values, out_scales)


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
        ctx.save_for_backward(qf, kf, vf, gf, *_saved_tensors(saved), *finals)
        ctx.lay, ctx.op, ctx.scale, ctx.powers, ctx.shape = lay, op, scale, powers, (b, t, h, dk, dv)
        ctx.h0_dtypes = tuple(None if x is None else x.dtype for x in (h0_inner, h0_outer))
        ctx.g_dtype = None if g is None else g.dtype
        return o.reshape(b, t, h, dv), *finals

    @staticmethod
    def backward(ctx, do, d_final_inner, d_final_outer):
        qf, kf, vf, gf, *rest = ctx.saved_tensors
        saved, finals = _saved_from(rest[:6]), rest[6:]
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
# backward needs (the inner pass's output K~ or V~ and both passes' chunk states with their scales) as outputs of its
# own, so the backward recomputes nothing; their shapes follow from the inputs' (rows = B * ceil(T / BT) chunk rows).
@torch.library.custom_op("hilo::hla_fused", mutates_args=())
@dense_outputs
def _hla_fused_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],  # noqa: UP045
                  op: str, scale: float, p_in: int, p_out: int, out_fp32: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                             torch.Tensor]:
    """(o [B, T, H, V] in v's dtype, or fp32 with out_fp32; the inner output K~ [B*T, H, K] (hla2) or V~ [B*T, H, V]
    (ahla) and its scales: fp32 and empty, or with mid16 fp16 and fp32 (MidTokens); the inner chunk states [rows, H,
    K, K or V] and their scales, the outer ones [rows, H, K, V] and theirs: fp32 states and empty scales, or with
    states16 fp16 states and fp32 scales (ChunkStates))."""
    qf, kf, vf, gf, lay = _flat(q, k, v, g)
    o, _, saved = fused_fwd(op, qf, kf, vf, gf, scale, (p_in, p_out), (None, None), lay, False,
                            torch.float32 if out_fp32 else v.dtype)
    return o.reshape(v.shape), *_saved_tensors(saved)


@_hla_fused_op.register_fake
def _(q, k, v, g, op, scale, p_in, p_out, out_fp32):
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    rows = b * triton.cdiv(t, BT)
    inner = dk if op == "hla2" else dv
    f32 = torch.float32
    half = _states16(q)

    def states(dy):
        by = _scan_blocks(dk, dy, b * h)[1]
        return (q.new_empty(rows, h, dk, dy, dtype=torch.float16 if half else f32),
                q.new_empty((rows, h, dk, triton.cdiv(dy, by)) if half else (0,), dtype=f32))

    mid16 = _mid16(q)
    by = _pow2(inner, hi=_launch("out_by", dk))
    return (v.new_empty(v.shape, dtype=f32 if out_fp32 else v.dtype),
            q.new_empty(b * t, h, inner, dtype=torch.float16 if mid16 else f32),
            q.new_empty((b * t, h, triton.cdiv(inner, by)) if mid16 else (0,), dtype=f32), *states(inner), *states(dv))


@torch.library.custom_op("hilo::hla_fused_backward", mutates_args=())
@dense_outputs
def _hla_fused_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           g: Optional[torch.Tensor], mid: torch.Tensor, mid_scales: torch.Tensor,  # noqa: UP045
                           in_states: torch.Tensor, in_scales: torch.Tensor, out_states: torch.Tensor,
                           out_scales: torch.Tensor, op: str, scale: float, p_in: int, p_out: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv in their inputs' dtypes, dg in g's dtype (empty without g))."""
    qf, kf, vf, gf, lay = _flat(q, k, v, g)
    b, t, h, _ = q.shape
    dof = do.reshape(b * t, h, do.shape[-1]).contiguous()
    saved = _saved_from((mid, mid_scales, in_states, in_scales, out_states, out_scales))
    dq, dk, dv, dg, _ = fused_bwd(op, qf, kf, vf, gf, saved, (None, None), dof, (None, None), scale, (p_in, p_out), lay,
                                  need_h0=False)
    dg = q.new_empty(0, dtype=torch.float32) if g is None else dg.reshape(g.shape).to(g.dtype)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), dg


@_hla_fused_backward_op.register_fake
def _(do, q, k, v, g, mid, mid_scales, in_states, in_scales, out_states, out_scales, op, scale, p_in, p_out):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(0, dtype=torch.float32) if g is None else g.new_empty(g.shape))


def _hla_fused_setup(ctx, inputs, output):
    q, k, v, g, op, scale, p_in, p_out, _ = inputs
    ctx.save_for_backward(q, k, v, g, *output[1:])
    ctx.args = (op, scale, p_in, p_out)


def _hla_fused_grads(ctx, do, *_d_saved):
    q, k, v, g, *saved = ctx.saved_tensors
    dq, dk, dv, dg = _hla_fused_backward_op(do, q, k, v, g, *saved, *ctx.args)
    return dq, dk, dv, (dg if g is not None else None), None, None, None, None, None


_hla_fused_op.register_autograd(_hla_fused_grads, setup_context=_hla_fused_setup)


def hla_fused(op, q, k, v, g, decay, normalize, eps, scale, initial_state, output_final_state, cu_seqlens):
    """Backend "fused" of kernels.hla2 and kernels.ahla (same contract); inputs already validated. Returns
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
