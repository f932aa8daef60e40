"""Triton forward of chunked linear attention (chunk BT = 64, fp32 accumulation, log-space gates).

Two kernels over a packed token axis [TT = B*T, H, D] (documents from cu_seqlens, or B rows of T tokens); q and k
may have G <= H heads (groups, H % G == 0: head h reads group h // (H / G), as Mamba-2's B and C with n_groups), read
in place rather than repeated to H heads:
  1. `_chunk_states_fwd`, one program per (document, head, K-block, V-block), walks the document's chunks in
     order and stores the state entering each chunk (hs[c] = S_in, in the inputs' dtype), then the final
     state (fp32):  S <- exp(gl) S + (k * exp(gl - gc))^T v.
  2. `_chunk_out_fwd`, one program per (V-block, chunk, head), all chunks in parallel:
     o = scale * ( exp(gc) * (q S_in) + ((q k^T) * exp(gc_i - gc_j) * [j <= i]) v ).
gc is the in-chunk inclusive cumsum of g and gl its last value, so every exponent is <= 0. Chunk boundaries
come from a device-side table (hilo_kernels.common.varlen) or, without cu_seqlens, from T: no host sync. T and the
token counts are not specialised on (`do_not_specialize`), so a new T never recompiles.
"""

import torch
import triton
import triton.language as tl

from hilo_kernels.common.gpu import DEFAULT_MULTIPROCESSORS, multiprocessors
from hilo_kernels.common.launch import current
from hilo_kernels.common.varlen import chunk_table

BT = 64
# 16-bit inputs multiply _chunk_out_fwd's intra-chunk scores into v as two 16-bit halves (the scores rounded, then
# what rounding left out, rounded) instead of one rounded copy, one more [BT, BT] x [BT, BV] product: that rounding
# is the largest the kernel adds, and on the H200 (bf16 check of docs/kernels.md, 16K x 2, H = 16, D = 128) o's error
# ratio went 3.73e-3 -> 3.36e-3 for linear_attn, 5.00e-3 -> 4.33e-3 (of 5e-3) for ahla's bf16 composition, for
# 1.989 -> 1.998 ms fwd+bwd.
# Launch settings (warps, stages, the state kernels' tiles and segments): hilo_kernels.common.launch's LinearAttn table
# (docs/kernel_settings.md). The sequential state kernels walk each document's chunks one after another (~1.3-1.5 us
# a chunk on the H200), so at long T they dominate; 3 stages measured fastest (fwd+bwd at 16K x 2 / 32K x 1: 1 stage
# 2.35 / 3.27 ms, 2 stages 2.00 / 2.59, 3 stages 1.98 / 2.56, 4 stages 1.99 / 2.57). The fused backward takes 4 warps:
# at 16K x 2 (bf16, K = V = 128) fwd+bwd 1.910 ms against 1.979 with 8, hla2 3.899 against 4.015, although ptxas
# spills 416 bytes a thread there (none at 8 warps).


@triton.jit
def _chunk_bounds(table, i_c, T, NT, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(start, end) tokens of chunk i_c on the packed axis."""
    if IS_VARLEN:
        start = tl.load(table + i_c * 3).to(tl.int64)
        end = tl.load(table + i_c * 3 + 1).to(tl.int64)
    else:
        i_n = i_c // NT
        start = (i_n * T + (i_c % NT) * BT).to(tl.int64)
        end = tl.minimum(start + BT, (i_n + 1) * T).to(tl.int64)
    return start, end


@triton.jit
def _seq_bounds(bounds, offsets, i_n, T, NT, IS_VARLEN: tl.constexpr):
    """(bos, eos, first chunk index) of document i_n."""
    if IS_VARLEN:
        bos = tl.load(bounds + i_n).to(tl.int64)
        eos = tl.load(bounds + i_n + 1).to(tl.int64)
        c0 = tl.load(offsets + i_n).to(tl.int64)
    else:
        bos = (i_n * T).to(tl.int64)
        eos = bos + T
        c0 = (i_n * NT).to(tl.int64)
    return bos, eos, c0


@triton.jit
def _through_segment(state, fin, gseg, j, i_nh, kv_off, m_kv, K: tl.constexpr, V: tl.constexpr, HAS_G: tl.constexpr):
    """A state tile carried across segment j of its document: decayed by the segment's gates' sum, plus the segment's
    own contribution (fin [segments, N H, K, V], gseg [segments, N H]; program axis 1 is N H)."""
    row = j * tl.num_programs(1) + i_nh
    if HAS_G:
        state *= tl.exp(tl.load(gseg + row).to(tl.float32))  # .to: unsegmented launches pass hs as a dummy
    return state + tl.load(fin + row.to(tl.int64) * K * V + kv_off, mask=m_kv, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["T", "NT", "SEG"])
def _chunk_states_fwd(k, v, g, h0, hs, ht, fin, gseg, bounds, offsets, T, NT, SEG,
                      H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, HAS_G: tl.constexpr, HAS_H0: tl.constexpr,
                      STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr, FINALS: tl.constexpr):
    """The state entering each chunk of segment program_id(2): chunks [i_s SEG, (i_s + 1) SEG) of a document, which
    has cdiv(its chunks, SEG) segments (one unless segment_count says otherwise). FINALS: the segment's own
    contribution to the state where it ends, fin [segments, N H, K, V] fp32, walked from the end with each chunk's
    keys decayed to there (no product through the state between chunks), and from the K x V tile 0 program the sum of
    its gates, gseg [segments, N H] fp32; else start from h0 carried through the earlier segments' fin (each decayed
    by exp(gseg)) and store hs (and ht after the last one)."""
    i_kv, i_nh, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NV: tl.constexpr = triton.cdiv(V, BV)
    i_k, i_v = i_kv // NV, i_kv % NV
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, c0 = _seq_bounds(bounds, offsets, i_n, T, NT, IS_VARLEN)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    kv_off = o_k[:, None] * V + o_v[None, :]
    n_kv = tl.num_programs(1).to(tl.int64) * K * V  # one segment's slice of fin
    nchunks = tl.cdiv(eos - bos, BT)
    nseg = tl.maximum(nchunks - 1, 0) // SEG + 1  # this document's (a shorter one leaves programs idle)
    n_run = nseg
    if FINALS:
        n_run = nseg - 1  # the last segment's own contribution carries nowhere
    if i_s >= n_run:
        return
    state = tl.zeros([BK, BV], dtype=tl.float32)
    if not FINALS:
        if HAS_H0:
            state += tl.load(h0 + i_nh.to(tl.int64) * K * V + kv_off, mask=m_kv, other=0.0).to(tl.float32)
        for j in range(i_s):  # the state entering this segment, from the earlier segments' own contributions
            state = _through_segment(state, fin, gseg, j, i_nh, kv_off, m_kv, K, V, HAS_G)
    c_lo = i_s * SEG
    c_end = tl.minimum(c_lo + SEG, nchunks)
    rest = 0.0  # FINALS: the gates of the segment's later chunks
    for it in range(c_end - c_lo):
        if FINALS:  # from the segment's end: each token's decay to it is known, so a plain sum of products
            c = c_end - 1 - it
        else:
            c = c_lo + it
            tl.store(hs + ((c0 + c) * H + i_h) * K * V + kv_off, state.to(hs.dtype.element_ty), mask=m_kv)
        o_t = bos + c * BT + tl.arange(0, BT)
        m_t = o_t < eos
        kb = tl.load(k + (o_t[:, None] * G + i_h // (H // G)) * K + o_k[None, :],
                     mask=m_t[:, None] & (o_k[None, :] < K), other=0.0)
        vb = tl.load(v + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_t[:, None] & (o_v[None, :] < V),
                     other=0.0)
        if HAS_G:
            gb = tl.load(g + o_t * H + i_h, mask=m_t, other=0.0).to(tl.float32)
            gc = tl.cumsum(gb, 0)
            gl = tl.sum(gb, 0)
            if FINALS:
                kb = (kb * tl.exp(rest + gl - gc)[:, None]).to(vb.dtype)
                rest += gl
            else:
                state *= tl.exp(gl)
                kb = (kb * tl.exp(gl - gc)[:, None]).to(vb.dtype)
        state += tl.dot(tl.trans(kb), vb, input_precision=PREC)
    if FINALS:
        tl.store(fin + i_s * n_kv + i_nh.to(tl.int64) * K * V + kv_off, state, mask=m_kv)
        if HAS_G:  # noqa: SIM102 (a constexpr around a runtime test)
            if i_kv == 0:  # the segment's gates' sum, for the second launch's carry
                tl.store(gseg + i_s * tl.num_programs(1) + i_nh, rest)
    elif STORE_HT:  # noqa: SIM102 (a constexpr around a runtime test)
        if i_s == nseg - 1:
            tl.store(ht + i_nh.to(tl.int64) * K * V + kv_off, state, mask=m_kv)


@triton.jit(do_not_specialize=["T", "NT"])
def _chunk_out_fwd(q, k, v, g, hs, o, table, scale, T, NT,
                   H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
                   SPLIT: tl.constexpr):
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = _chunk_bounds(table, i_c, T, NT, BT, IS_VARLEN)
    if start >= end:
        return
    o_t = start + tl.arange(0, BT)
    m_t = o_t < end
    o_v = i_v * BV + tl.arange(0, BV)
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    scores = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_qk = m_t[:, None] & (o_k[None, :] < K)
        qb = tl.load(q + (o_t[:, None] * G + i_h // (H // G)) * K + o_k[None, :], mask=m_qk, other=0.0)
        kb = tl.load(k + (o_t[:, None] * G + i_h // (H // G)) * K + o_k[None, :], mask=m_qk, other=0.0)
        hb = tl.load(hs + (i_c.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                     mask=(o_k[:, None] < K) & (o_v[None, :] < V), other=0.0)
        acc += tl.dot(qb, hb.to(qb.dtype), input_precision=PREC)
        scores += tl.dot(qb, tl.trans(kb), input_precision=PREC)
    o_i = tl.arange(0, BT)
    causal = o_i[:, None] >= o_i[None, :]
    if HAS_G:
        gc = tl.cumsum(tl.load(g + o_t * H + i_h, mask=m_t, other=0.0).to(tl.float32), 0)
        acc *= tl.exp(gc)[:, None]
        scores *= tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
    scores = tl.where(causal, scores, 0.0)
    vb = tl.load(v + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_t[:, None] & (o_v[None, :] < V),
                 other=0.0)
    scores_hi = scores.to(vb.dtype)
    acc += tl.dot(scores_hi, vb, input_precision=PREC)
    if SPLIT:  # 16-bit inputs: what rounding the scores left out, as a second 16-bit operand (see the top)
        acc += tl.dot((scores - scores_hi.to(tl.float32)).to(vb.dtype), vb, input_precision=PREC)
    tl.store(o + (o_t[:, None] * H + i_h) * V + o_v[None, :], (acc * scale).to(o.dtype.element_ty),
             mask=m_t[:, None] & (o_v[None, :] < V))


def dot_precision(x: torch.Tensor) -> str:
    """fp32 inputs multiply in full fp32 ("ieee"); tf32 would miss the 1e-4 fp32 tolerance."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _pow2(x: int, lo: int = 16, hi: int = 128) -> int:
    return max(lo, min(hi, triton.next_power_of_2(x)))


class Layout:
    """Packed-axis bookkeeping shared by the forward and backward launches (all on device, no sync)."""

    def __init__(self, batch: int, seqlen: int, heads: int, cu_seqlens: torch.Tensor | None, device):
        self.total = batch * seqlen
        self.heads = heads
        self.varlen = cu_seqlens is not None
        if self.varlen:
            self.bounds = cu_seqlens.to(device=device, dtype=torch.int64)
            self.n = self.bounds.numel() - 1
            self.table, self.offsets = chunk_table(self.bounds, self.total, BT)
            self.rows = self.table.shape[0]
            self.seqlen, self.nt = 0, 0
        else:
            self.n = batch
            self.seqlen = seqlen
            self.nt = triton.cdiv(seqlen, BT)
            self.rows = batch * self.nt
            self.bounds = self.offsets = self.table = torch.empty(1, dtype=torch.int32, device=device)


def state_blocks(dk: int, dv: int, programs_per_block: int) -> tuple[int, int]:
    """K/V tiles of the sequential state kernels: 64x64, narrowed to 64x32 and then 32x32 while the grid has fewer
    than 256 programs (the launch settings' state_bk / state_bv override either). Each program walks every chunk of its document
    at ~1.3-1.5 us a chunk on the H200, whatever its tile, so on few sequence-heads more, smaller programs finish
    sooner: at 32K x 1, H = 16 (16 sequence-heads) 32x32 took linear_attn fwd+bwd from 2.59 to 2.46 ms;
    at 16K x 2 the 256 programs of 64x32 were as fast as 512 of 32x32."""
    bk, bv = _pow2(dk, hi=64), _pow2(dv, hi=64)

    def programs():
        return programs_per_block * triton.cdiv(dk, bk) * triton.cdiv(dv, bv)

    if programs() < 256 and bv > 32:
        bv = 32
    if programs() < 256 and bk > 32:
        bk = 32
    launch = current("linear_attn")
    if launch.state_bk:
        bk = _pow2(dk, hi=launch.state_bk)
    if launch.state_bv:
        bv = _pow2(dv, hi=launch.state_bv)
    return bk, bv


# Blocks of a state kernel resident on one multiprocessor (AOT for sm_90, Triton 3.6, bf16 at 32x32 tiles: 6-7, by
# registers); segment_count fills the GPU to this many a multiprocessor and no further.
STATE_BLOCKS_PER_SM = 6
# The shortest walk segment_count's rule segments (32K tokens): the H200 sped up every measured walk of 512 chunks or
# more on a narrow grid and slowed the call of the one of 256, by host time (see segment_count).
SEGMENT_MIN_CHUNKS = 512


def segment_count(nt: int, programs: int, multiprocessors: int = DEFAULT_MULTIPROCESSORS) -> int:
    """How many segments the sequential state kernels split a document of up to nt chunks into, for a grid of
    `programs` per segment (the launch settings' state_segments: None, the default, the rule below; 1 none; n, n). In segments the
    walks are shorter and run side by side, after a first launch that takes each segment's own contribution (a plain
    sum of products, no walk through the state) and its gates' sum, at the price of one more launch each way and
    one more read of the kernels' inputs. That pays only where the walk's length sets the time: a long walk on a
    grid narrower than the GPU. On the H200 (bf16, K = V = 128, fwd+bwd) the rule took 32K x 1 at H = 4
    (64 programs, 12 segments) from 1.49 to 1.24 ms, at H = 8 (128 programs, 6) from 1.81 to 1.25, 64K x 1 at H = 4
    from 2.94 to 1.24; but 16K x 1 at H = 8 (a walk of 256 chunks in 6 segments) from 0.99 to 1.20, although its GPU
    kernel time fell from 0.90 to 0.62 ms (by a profile: the loss is the call's host time, its extra
    launches, which a busy training step may hide; not yet timed there), and at 16K x 2, H = 16 (256 programs, 3
    segments; the first form, with the gate sums in torch) the two walks' kernel time went from 0.74 to 0.84 ms
    (there the walks are bound by throughput, not by their length). The rule: none on
    a grid of at least one program a multiprocessor or a walk under SEGMENT_MIN_CHUNKS; else as many as fit the
    programs in one wave (STATE_BLOCKS_PER_SM a multiprocessor: a second wave would double the walk again), none
    shorter than 16 chunks. With packed documents nt is the longest a document can be, and shorter ones leave some
    segments' programs idle."""
    want = current("linear_attn").state_segments
    if want == 1:
        return 1
    if not want:
        if programs >= multiprocessors or nt < SEGMENT_MIN_CHUNKS:
            return 1
        want = min(STATE_BLOCKS_PER_SM * multiprocessors // programs, nt // 16)
    want = max(1, min(want, nt))
    return triton.cdiv(nt, triton.cdiv(nt, want))  # every segment non-empty


def segments(dk: int, dv: int, lay: Layout, bk: int, bv: int, device):
    """(chunks a segment, segments) of the state kernels' launches for these tiles; one segment covers any
    document."""
    nt = lay.nt if not lay.varlen else triton.cdiv(lay.total, BT)
    nseg = segment_count(nt, triton.cdiv(dk, bk) * triton.cdiv(dv, bv) * lay.n * lay.heads, multiprocessors(device))
    return (triton.cdiv(nt, nseg) if nseg > 1 else 2 ** 31 - 1), nseg


def segment_launch(g, lay: Layout, dk: int, dv: int, bk: int, bv: int, device):
    """What a sequential state kernel's launches need (shared by the forward and backward passes): (chunks a
    segment, segments, fin [segments, N H, K, V] fp32 or None, the segments' gate sums or None, K x V tiles)."""
    seg, nseg = segments(dk, dv, lay, bk, bv, device)
    fin = gseg = None
    if nseg > 1:  # both filled by the first (FINALS) launch: no torch ops, whose host time a short call would feel
        fin = torch.empty(nseg, lay.n * lay.heads, dk, dv, device=device, dtype=torch.float32)
        gseg = torch.empty(nseg, lay.n * lay.heads, device=device, dtype=torch.float32) if g is not None else None
    return seg, nseg, fin, gseg, triton.cdiv(dk, bk) * triton.cdiv(dv, bv)


def chunk_states(k, v, g, h0, lay: Layout, store_final: bool):
    """hs [rows, H, K, V] in k's dtype (state entering each chunk) and the final state [N, H, K, V] fp32; k [TT, G, K]
    (G dividing H)."""
    dk, dv = k.shape[-1], v.shape[-1]
    h = lay.heads
    hs = torch.empty(lay.rows, h, dk, dv, device=k.device, dtype=k.dtype)
    ht = torch.empty(lay.n, h, dk, dv, device=k.device, dtype=torch.float32) if store_final else None
    bk, bv = state_blocks(dk, dv, lay.n * h)
    seg, nseg, fin, gseg, tiles = segment_launch(g, lay, dk, dv, bk, bv, k.device)

    def launch(nprog: int, finals: bool):
        _chunk_states_fwd[(tiles, lay.n * h, nprog)](
            k, v, g if g is not None else k, h0 if h0 is not None else k, hs, ht if ht is not None else hs,
            fin if fin is not None else hs, gseg if gseg is not None else hs, lay.bounds, lay.offsets, lay.seqlen,
            lay.nt, seg, H=h, G=k.shape[1], K=dk, V=dv, BT=BT, BK=bk, BV=bv, HAS_G=g is not None,
            HAS_H0=h0 is not None, STORE_HT=store_final, IS_VARLEN=lay.varlen, PREC=dot_precision(k), FINALS=finals,
            num_warps=current("linear_attn").state_warps, num_stages=current("linear_attn").state_stages)

    if nseg > 1:  # the last segment's own contribution carries nowhere
        launch(nseg - 1, True)
    launch(nseg, False)
    return hs, ht


def chunk_fwd(q, k, v, g, scale, h0, lay: Layout, store_final: bool):
    """q, k [TT, G, K] (G dividing H), v [TT, H, V] contiguous, g [TT, H] fp32 or None -> (o [TT, H, V], final or
    None, hs)."""
    dk, dv = q.shape[-1], v.shape[-1]
    hs, ht = chunk_states(k, v, g, h0, lay, store_final)
    o = torch.empty_like(v)
    bv = _pow2(dv, hi=64)
    # Triton 3.6 on Hopper miscompiles this kernel in bf16 when the V tile is narrower than the K tile and under
    # 64 wide (wrong outputs at BK x BV = 64x16, 64x32, 128x16; an illegal access at 32x16). 128x64 and every BK <= BV tile were exact, so narrow V tiles walk K in BV steps.
    bk = _pow2(dk) if bv >= 64 else min(_pow2(dk), bv)
    grid = (triton.cdiv(dv, bv), lay.rows, lay.heads)
    _chunk_out_fwd[grid](q, k, v, g if g is not None else q, hs, o, lay.table, scale, lay.seqlen, lay.nt,
                         H=lay.heads, G=q.shape[1], K=dk, V=dv, BT=BT, BK=bk, BV=bv, HAS_G=g is not None,
                         IS_VARLEN=lay.varlen, PREC=dot_precision(k),
                         SPLIT=v.element_size() == 2,
                         num_warps=current("linear_attn").out_warps, num_stages=current("linear_attn").out_stages)
    return o, ht, hs
