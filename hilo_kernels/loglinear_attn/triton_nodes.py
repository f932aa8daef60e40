"""The chunk levels of log-linear attention as a tree of node states, every chunk in parallel (no scan).

Notation of triton_fwd: chunk rows of C = 64 tokens aligned to absolute positions, chunk c (absolute index) of a
sequence whose chunks are c0 .. c_last; G the in-document cumsum of g. Chunk c reads chunk level j (1-based, Fenwick
level 6 + j) when bit j-1 of c is set, and the tokens it reads there are those of the chunks
    [c >> j << j, (c >> j << j) + 2^(j-1))  (clipped at c0: earlier chunks belong to the prior)
which is the left half of c's aligned block of 2^j chunks. That range ends at e = (c >> j << j) + 2^(j-1) - 1, whose
trailing ones are exactly j - 1: every chunk row is the last chunk of exactly one such range (its "node", level
j = trailing_ones(e) + 1), so the nodes of all levels fit in one [rows, H, K, V] buffer, like linear attention's
per-chunk states:
    N_e = sum_{s in the range} exp(G_end(e) - G_s) k_s v_s^T
    o_t += scale lambda_t[6 + j] exp(G_t - G_end(e)) q_t N_e           (t in chunk c, one term per set bit j of c)
A level scan would carry the same states chunk to chunk; here
  1. `_node_fwd`, one program per (V-block, row, head): N_e as one [K, BV] accumulation over the range's chunks
     (2^(j-1) of them; the levels together cost NJ / 2 times linear attention's state pass);
  2. `_read_fwd`, one program per (V-block, row, head): o += the reads of every set bit, one [C, K] @ [K, BV] dot each.
Backward:
  3. `_node_bwd`, per (V-block, row, head): dN_e = sum over the readers (the right half's chunks) of
     scale lambda_t[6 + j] exp(G_t - G_end(e)) q_t^T do_t, plus the final state's gradient where N_e is one of the
     final chunk-level states;
  4. `_grads`, per (row, head), all V-blocks in turn: for every set bit j (reads) dq and dlambda_t[6 + j]; for every
     clear bit j (the chunk is in the range of the node e = c | (2^(j-1) - 1)) dk and dv from dN_e.
The gate enters only through exp(G_t - G_end(e)) and exp(G_end(e) - G_s): the per-(row, level) factors
exp(G_before(c) - G_end(e)) and exp(G_end(e) - G_end(c)) come from a float64 chunk-level cumsum in torch, and the
in-chunk parts (exp(gc_t), exp(gl - gc_s)) from the kernels' in-chunk cumsum, so no fp32 difference of two large
cumsums is taken. Which node each (row, level) reads or feeds is a host-built table (LevelLayout.node_tables).
All programs are independent: the work is parallel over chunks instead of sequential over them.
"""

import functools

import torch
import triton
import triton.language as tl

from hilo_kernels.common.launch import current, loglinear_attn_grads_split

from .triton_fwd import CHUNK, LevelLayout, _chunk_rows, _mm, dot_precision, pow2


class NodeTables:
    """Host-built index tables of the node form for one LevelLayout (on the device):
    info int32 [rows, 3]: (node level j of the row, 0 when no chunk reads it and it is not a final state; the first
        row of its range; the last row that reads it, the row itself when none);
    read_rows int32 [rows, NJP]: the node row chunk level jj + 1 reads at this row, -1 when bit jj is clear or the
        range lies before the sequence;
    write_rows int32 [rows, NJP]: the node whose range holds this row at chunk level jj + 1 when bit jj is clear and
        that node is needed, else -1;
    read_list, write_list int32 [rows, NJP, 2] and n_read, n_write int32 [rows]: the same as packed (jj, node row)
        lists, so the kernels loop over exactly the levels they use with unconditional loads (which Triton can
        pipeline) instead of testing every level;
    final_rows int64 [N, nj]: the node of chunk level jj + 1 in each sequence's final state (-1: none);
    row_seq_first int64 [rows]: the first row of each row's sequence."""

    def __init__(self, lay: LevelLayout, device):
        nj = lay.nj
        self.njp = pow2(nj, 1)
        rows = lay.rows
        info = [(0, 0, 0)] * rows
        read = [[-1] * self.njp for _ in range(rows)]
        write = [[-1] * self.njp for _ in range(rows)]
        final = [[-1] * nj for _ in range(lay.n)]
        first = [0] * rows
        for n, (r0, count, c0) in enumerate(zip(lay.first_rows, lay.chunk_counts, (p // CHUNK for p in lay.starts))):
            if count == 0:
                continue
            c_last = c0 + count - 1
            row = (lambda c, r0=r0, c0=c0: r0 + c - c0)  # the row of chunk c in this sequence
            needed = set()
            for c in range(c0, c_last + 1):
                first[row(c)] = r0
                for jj in range(nj):
                    if (c >> jj) & 1:
                        e = ((c >> (jj + 1)) << (jj + 1)) + (1 << jj) - 1
                        if e >= c0:
                            read[row(c)][jj] = row(e)
                            needed.add(e)
            for jj in range(nj):
                if (c_last >> jj) & 1:
                    e = ((c_last >> (jj + 1)) << (jj + 1)) + (1 << jj) - 1
                    if e >= c0:
                        final[n][jj] = row(e)
                        needed.add(e)
            for e in needed:
                j = ((e ^ (e + 1)).bit_length() - 1) + 1
                last_reader = min(e + (1 << (j - 1)), c_last)
                info[row(e)] = (j, row(max(e - (1 << (j - 1)) + 1, c0)), row(last_reader))
            for c in range(c0, c_last + 1):
                for jj in range(nj):
                    if not (c >> jj) & 1:
                        e = c | ((1 << jj) - 1)
                        if e in needed:
                            write[row(c)][jj] = row(e)
        self.info = torch.tensor(info, dtype=torch.int32).reshape(rows, 3).to(device)
        self.read_rows = torch.tensor(read, dtype=torch.int32).reshape(rows, self.njp).to(device)
        self.write_rows = torch.tensor(write, dtype=torch.int32).reshape(rows, self.njp).to(device)
        lists = {}
        for name, table in (("read", read), ("write", write)):
            packed = [[(jj, e) for jj, e in enumerate(row) if e >= 0] for row in table]
            counts = [len(p) for p in packed]
            packed = [p + [(0, 0)] * (self.njp - len(p)) for p in packed]
            lists[name] = (torch.tensor(packed, dtype=torch.int32).reshape(rows, self.njp, 2).to(device),
                           torch.tensor(counts, dtype=torch.int32).reshape(rows).to(device))
        self.read_list, self.n_read = lists["read"]
        self.write_list, self.n_write = lists["write"]
        self.final_rows = torch.tensor(final, dtype=torch.int64).reshape(lay.n, nj).to(device)
        # the distinct final rows, and each (sequence, level)'s place among them (0 where none)
        listed = sorted({e for row in final for e in row if e >= 0})
        place = {e: i for i, e in enumerate(listed)}
        self.final_list = torch.tensor(listed, dtype=torch.int32, device=device)
        self.final_pos = torch.tensor([[place.get(e, 0) for e in row] for row in final], dtype=torch.int64,
                                      device=device).reshape(lay.n, nj)
        self.row_seq_first = torch.tensor(first, dtype=torch.int64, device=device)
        self.row_of_token = (lay.chunk_pos // CHUNK).to(device)


@functools.lru_cache(maxsize=16)
def _tables(lay: LevelLayout) -> NodeTables:
    return NodeTables(lay, lay.chunks.device)


def node_tables(lay: LevelLayout) -> NodeTables:
    """NodeTables of a layout, built once (layouts are themselves cached per batch shape)."""
    return _tables(lay)


def gate_factors(g, lay: LevelLayout, tab: NodeTables, h: int):
    """(read factors rf, write factors wf [rows, H, NJP] fp32, end cumsums A [rows, H] float64): rf[r, :, jj] =
    exp(G_before(c) - G_end(read node)), wf[r, :, jj] = exp(G_end(write node) - G_end(c)), 0 where no node; A the
    in-document cumsum of g at the end of each chunk (None without a gate: the factors are 1 where a node is)."""
    rows, njp = lay.rows, tab.njp
    dev = tab.read_rows.device
    rr, wr = tab.read_rows.long(), tab.write_rows.long()
    if g is None:
        return (rr >= 0).float()[:, None, :].expand(rows, h, njp).contiguous(), \
            (wr >= 0).float()[:, None, :].expand(rows, h, njp).contiguous(), None
    gl = torch.zeros(rows, h, dtype=torch.float64, device=dev).index_add_(0, tab.row_of_token, g.double())
    cs = gl.cumsum(0)
    first = tab.row_seq_first
    a_end = cs - (cs[first] - gl[first])  # G at each chunk's end, from its document's start
    a_before = a_end - gl
    take = (lambda tbl: a_end[tbl.clamp(min=0)].transpose(1, 2))  # [rows, H, NJP]
    rf = torch.where((rr >= 0)[:, None, :], torch.exp(a_before[:, :, None] - take(rr)), 0.0)
    wf = torch.where((wr >= 0)[:, None, :], torch.exp(take(wr) - a_end[:, :, None]), 0.0)
    return rf.float().contiguous(), wf.float().contiguous(), a_end


@triton.jit
def _chunk_gate(g, o_t, m_t, i_h, H: tl.constexpr, C: tl.constexpr, HAS_G: tl.constexpr):
    """In-chunk inclusive cumsum gc [C] and the chunk total gl of the gate (zeros without one)."""
    gb = tl.zeros([C], dtype=tl.float32)
    if HAS_G:
        gb = tl.load(g + o_t * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    return tl.cumsum(gb, 0), tl.sum(gb, 0)


@triton.jit
def _node_fwd(k, v, g, nodes, chunks, info, row_list,
              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, HAS_G: tl.constexpr, USE_LIST: tl.constexpr, LOWP: tl.constexpr,
              PREC: tl.constexpr):
    i_v, i_out, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if USE_LIST:  # only the listed rows' nodes, stored in list order
        i_r = tl.load(row_list + i_out)
    else:
        i_r = i_out
    j = tl.load(info + i_r * 3)
    first = tl.load(info + i_r * 3 + 1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    acc = tl.zeros([BK, BV], dtype=tl.float32)
    run = 0.0  # log decay from the end of the current chunk to the end of the node's range
    count = tl.where(j > 0, i_r - first + 1, 0)
    for it in range(count):
        base, lo, hi = _chunk_rows(chunks, i_r - it)
        o_t = base + tl.arange(0, C)
        m_t = (o_t >= lo) & (o_t < hi)
        gc, gl = _chunk_gate(g, o_t, m_t, i_h, H, C, HAS_G)
        kb = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None] & (o_k[None, :] < K),
                     other=0.0)
        vb = tl.load(v + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_t[:, None] & (o_v[None, :] < V),
                     other=0.0).to(tl.float32)
        acc += _mm(tl.trans(kb), vb * tl.exp(run + gl - gc)[:, None], k, LOWP, PREC)
        run += gl
    ptr = nodes + ((i_out.to(tl.int64) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    tl.store(ptr, acc.to(nodes.dtype.element_ty), mask=(o_k[:, None] < K) & (o_v[None, :] < V))


@triton.jit(do_not_specialize=["NL"])
def _read_fwd(q, g, lam, nodes, rf, read_list, n_read, o, chunks, scale, NL,
              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, NJP: tl.constexpr, LEV0: tl.constexpr, HAS_G: tl.constexpr, LOWP: tl.constexpr,
              PREC: tl.constexpr):
    i_v, i_r, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t, m_t, o_k, m_tk, gc, _gl = _row(chunks, g, i_r, i_h, H, K, C, BK, HAS_G)
    o_v = i_v * BV + tl.arange(0, BV)
    qb = tl.load(q + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
    acc = tl.zeros([C, BV], dtype=tl.float32)
    for i in range(tl.load(n_read + i_r)):
        jj = tl.load(read_list + (i_r * NJP + i) * 2)
        e = tl.load(read_list + (i_r * NJP + i) * 2 + 1)
        f = tl.load(rf + (i_r * H + i_h) * NJP + jj)
        lam_j = tl.load(lam + (o_t * H + i_h) * NL + LEV0 + jj, mask=m_t & ((tl.zeros_like(o_t) + LEV0 + jj) < NL),
                        other=0.0)
        nb = tl.load(nodes + ((e.to(tl.int64) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :],
                     mask=(o_k[:, None] < K) & (o_v[None, :] < V), other=0.0)
        acc += _mm(qb, nb, q, LOWP, PREC) * (lam_j.to(tl.float32) * f)[:, None]
    m_tv = m_t[:, None] & (o_v[None, :] < V)
    ptr = o + (o_t[:, None] * H + i_h) * V + o_v[None, :]
    tl.store(ptr, tl.load(ptr, mask=m_tv, other=0.0) + acc * (scale * tl.exp(gc))[:, None], mask=m_tv)


@triton.jit(do_not_specialize=["NL"])
def _node_bwd(q, g, lam, do, rf, dnodes, chunks, info, scale, NL,
              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, NJP: tl.constexpr, LEV0: tl.constexpr, HAS_G: tl.constexpr, LOWP: tl.constexpr,
              PREC: tl.constexpr):
    i_v, i_r, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    j = tl.load(info + i_r * 3)
    last = tl.load(info + i_r * 3 + 2)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    ptr = dnodes + ((i_r.to(tl.int64) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    acc = tl.zeros([BK, BV], dtype=tl.float32)  # (the final state's part is added by the caller)
    jj = tl.maximum(j - 1, 0)
    count = tl.where(j > 0, last - i_r, 0)
    for it in range(count):
        r = i_r + 1 + it
        base, lo, hi = _chunk_rows(chunks, r)
        o_t = base + tl.arange(0, C)
        m_t = (o_t >= lo) & (o_t < hi)
        gc, _gl = _chunk_gate(g, o_t, m_t, i_h, H, C, HAS_G)
        f = tl.load(rf + (r * H + i_h) * NJP + jj)
        lam_j = tl.load(lam + (o_t * H + i_h) * NL + LEV0 + jj, mask=m_t & ((tl.zeros_like(o_t) + LEV0 + jj) < NL), other=0.0)
        coef = lam_j.to(tl.float32) * (scale * f) * tl.exp(gc)
        qb = tl.load(q + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None] & (o_k[None, :] < K),
                     other=0.0)
        dob = tl.load(do + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_t[:, None] & (o_v[None, :] < V),
                      other=0.0).to(tl.float32)
        acc += _mm(tl.trans(qb), dob * coef[:, None], q, LOWP, PREC)
    tl.store(ptr, acc, mask=m_kv)


@triton.jit
def _row(chunks, g, i_r, i_h, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
         HAS_G: tl.constexpr):
    """Chunk row i_r's tokens o_t, real-token mask m_t, key offsets o_k, their [C, BK] mask and the gate's in-chunk
    cumsum gc and total gl."""
    base, lo, hi = _chunk_rows(chunks, i_r)
    o_t = base + tl.arange(0, C)
    m_t = (o_t >= lo) & (o_t < hi)
    o_k = tl.arange(0, BK)
    gc, gl = _chunk_gate(g, o_t, m_t, i_h, H, C, HAS_G)
    return o_t, m_t, o_k, m_t[:, None] & (o_k[None, :] < K), gc, gl


@triton.jit
def _read_levels(q, lam, nodes, rf, read_list, reads, d_q, d_l, qb, dob, i_r, i_h, o_t, m_t, o_k, o_v, o_j, NL,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, NJP: tl.constexpr, LEV0: tl.constexpr,
                 LOWP: tl.constexpr, PREC: tl.constexpr):
    """One V-block of the levels chunk row i_r reads: d_q += lambda f do N_e^T, d_l[:, jj] += f <q N_e, do> (before
    the row factor scale exp(gc))."""
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    for i in range(reads):
        jj = tl.load(read_list + (i_r * NJP + i) * 2)
        e = tl.load(read_list + (i_r * NJP + i) * 2 + 1)
        f = tl.load(rf + (i_r * H + i_h) * NJP + jj)
        lam_j = tl.load(lam + (o_t * H + i_h) * NL + LEV0 + jj,
                        mask=m_t & ((tl.zeros_like(o_t) + LEV0 + jj) < NL), other=0.0).to(tl.float32)
        nb = tl.load(nodes + ((e.to(tl.int64) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :], mask=m_kv,
                     other=0.0)
        dq_j = _mm(dob, tl.trans(nb), q, LOWP, PREC)  # do N_e^T: <q N_e, do> is its row-dot with q
        d_q += dq_j * (lam_j * f)[:, None]
        d_l = tl.where(o_j[None, :] == jj, d_l + (tl.sum(dq_j * qb.to(tl.float32), 1) * f)[:, None], d_l)
    return d_q, d_l


@triton.jit
def _write_levels(k, dnodes, wf, write_list, writes, d_k, kb, vb, i_r, i_h, o_k, o_v, C: tl.constexpr,
                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, NJP: tl.constexpr,
                  LOWP: tl.constexpr, PREC: tl.constexpr):
    """One V-block of the nodes whose ranges hold chunk row i_r: d_k += f v dN^T; returns (d_k, this block's
    f k dN) (before the row factor exp(gl - gc))."""
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    d_v = tl.zeros([C, BV], dtype=tl.float32)
    for i in range(writes):
        jj = tl.load(write_list + (i_r * NJP + i) * 2)
        w = tl.load(write_list + (i_r * NJP + i) * 2 + 1)
        f = tl.load(wf + (i_r * H + i_h) * NJP + jj)
        dnb = tl.load(dnodes + ((w.to(tl.int64) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :], mask=m_kv,
                      other=0.0) * f
        d_k += _mm(vb, tl.trans(dnb), k, LOWP, PREC)
        d_v += _mm(kb, dnb, k, LOWP, PREC)
    return d_k, d_v


@triton.jit
def _finish(src, dst, acc, row_scale, ptr_off, mask):
    """dst = src (the intra kernel's part) + acc * row_scale (stored in dst's dtype); returns that sum (fp32)."""
    total = tl.load(src + ptr_off, mask=mask, other=0.0) + acc * row_scale[:, None]
    tl.store(dst + ptr_off, total, mask=mask)
    return total


@triton.jit
def _finish_dlam(dlam, d_l, q_scale, o_t, m_t, o_j, i_h, NL, NJT, H: tl.constexpr, LEV0: tl.constexpr):
    m_l = m_t[:, None] & (o_j[None, :] < NJT) & (LEV0 + o_j[None, :] < NL)
    ptr = dlam + (o_t[:, None] * H + i_h) * NL + LEV0 + o_j[None, :]
    tl.store(ptr, tl.load(ptr, mask=m_l, other=0.0) + d_l * q_scale[:, None], mask=m_l)


@triton.jit(do_not_specialize=["NL", "NJT"])
def _grads(q, k, v, g, lam, do, nodes, dnodes, rf, wf, read_list, n_read, write_list, n_write, dq, dk, dv, dlam,
           dq_out, dk_out, dv_out, dbig_g, chunks, scale, NL, NJT, H: tl.constexpr, K: tl.constexpr,
           V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NJP: tl.constexpr,
           LEV0: tl.constexpr, HAS_G: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr):
    """dq, dk, dv (the intra kernel's parts + the node parts, in the input dtype), dlambda of the chunk levels and
    dL/dG_t = q.dq - k.dk, one program per (row, head), V-blocks in turn."""
    i_r, i_h = tl.program_id(0), tl.program_id(1)
    o_t, m_t, o_k, m_tk, gc, gl = _row(chunks, g, i_r, i_h, H, K, C, BK, HAS_G)
    q_scale = scale * tl.exp(gc)
    k_scale = tl.exp(gl - gc)
    qb = tl.load(q + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
    kb = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
    o_j = tl.arange(0, NJP)
    d_q = tl.zeros([C, BK], dtype=tl.float32)
    d_k = tl.zeros([C, BK], dtype=tl.float32)
    d_l = tl.zeros([C, NJP], dtype=tl.float32)
    reads = tl.load(n_read + i_r)
    writes = tl.load(n_write + i_r)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v[None, :] < V)
        off = (o_t[:, None] * H + i_h) * V + o_v[None, :]
        dob = tl.load(do + off, mask=m_tv, other=0.0)
        vb = tl.load(v + off, mask=m_tv, other=0.0)
        d_q, d_l = _read_levels(q, lam, nodes, rf, read_list, reads, d_q, d_l, qb, dob, i_r, i_h, o_t, m_t, o_k, o_v,
                                o_j, NL, H, K, V, NJP, LEV0, LOWP, PREC)
        d_k, d_v = _write_levels(k, dnodes, wf, write_list, writes, d_k, kb, vb, i_r, i_h, o_k, o_v, C, H, K, V, BV,
                                 NJP, LOWP, PREC)
        _finish(dv, dv_out, d_v, k_scale, off, m_tv)
    off = (o_t[:, None] * H + i_h) * K + o_k[None, :]
    d_q = _finish(dq, dq_out, d_q, q_scale, off, m_tk)
    d_k = _finish(dk, dk_out, d_k, k_scale, off, m_tk)
    if HAS_G:
        d_g = tl.sum(qb.to(tl.float32) * d_q, 1) - tl.sum(kb.to(tl.float32) * d_k, 1)
        tl.store(dbig_g + o_t * H + i_h, d_g, mask=m_t)
    _finish_dlam(dlam, d_l, q_scale, o_t, m_t, o_j, i_h, NL, NJT, H, LEV0)


@triton.jit(do_not_specialize=["NL", "NJT"])
def _grads_read(q, g, lam, do, nodes, rf, read_list, n_read, dq, dlam, dq_out, dbig_g, chunks, scale, NL, NJT,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, NJP: tl.constexpr, LEV0: tl.constexpr, HAS_G: tl.constexpr, LOWP: tl.constexpr,
                PREC: tl.constexpr):
    """The read half of _grads (the node_grads_split setting): dq, dlambda and q.dq of dL/dG."""
    i_r, i_h = tl.program_id(0), tl.program_id(1)
    o_t, m_t, o_k, m_tk, gc, _gl = _row(chunks, g, i_r, i_h, H, K, C, BK, HAS_G)
    q_scale = scale * tl.exp(gc)
    qb = tl.load(q + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
    o_j = tl.arange(0, NJP)
    d_q = tl.zeros([C, BK], dtype=tl.float32)
    d_l = tl.zeros([C, NJP], dtype=tl.float32)
    reads = tl.load(n_read + i_r)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        dob = tl.load(do + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_t[:, None] & (o_v[None, :] < V),
                      other=0.0)
        d_q, d_l = _read_levels(q, lam, nodes, rf, read_list, reads, d_q, d_l, qb, dob, i_r, i_h, o_t, m_t, o_k, o_v,
                                o_j, NL, H, K, V, NJP, LEV0, LOWP, PREC)
    d_q = _finish(dq, dq_out, d_q, q_scale, (o_t[:, None] * H + i_h) * K + o_k[None, :], m_tk)
    if HAS_G:
        tl.store(dbig_g + o_t * H + i_h, tl.sum(qb.to(tl.float32) * d_q, 1), mask=m_t)
    _finish_dlam(dlam, d_l, q_scale, o_t, m_t, o_j, i_h, NL, NJT, H, LEV0)


@triton.jit
def _grads_write(k, v, g, dnodes, wf, write_list, n_write, dk, dv, dk_out, dv_out, dbig_g, chunks,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, NJP: tl.constexpr, HAS_G: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr):
    """The write half of _grads (after _grads_read): dk, dv and -k.dk of dL/dG."""
    i_r, i_h = tl.program_id(0), tl.program_id(1)
    o_t, m_t, o_k, m_tk, gc, gl = _row(chunks, g, i_r, i_h, H, K, C, BK, HAS_G)
    k_scale = tl.exp(gl - gc)
    kb = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
    d_k = tl.zeros([C, BK], dtype=tl.float32)
    writes = tl.load(n_write + i_r)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v[None, :] < V)
        off = (o_t[:, None] * H + i_h) * V + o_v[None, :]
        vb = tl.load(v + off, mask=m_tv, other=0.0)
        d_k, d_v = _write_levels(k, dnodes, wf, write_list, writes, d_k, kb, vb, i_r, i_h, o_k, o_v, C, H, K, V, BV,
                                 NJP, LOWP, PREC)
        _finish(dv, dv_out, d_v, k_scale, off, m_tv)
    d_k = _finish(dk, dk_out, d_k, k_scale, (o_t[:, None] * H + i_h) * K + o_k[None, :], m_tk)
    if HAS_G:
        ptr = dbig_g + o_t * H + i_h
        tl.store(ptr, tl.load(ptr, mask=m_t, other=0.0) - tl.sum(kb.to(tl.float32) * d_k, 1), mask=m_t)


def _node_lowp(dtype: torch.dtype) -> bool:
    """16-bit inputs: the node kernels' dots take 16-bit operands (node tiles rounded to the input dtype, fp32
    accumulation; every tile is at least 64 wide) instead of tf32 products of fp32 tiles: 14.1 -> 10.2 ms fwd+bwd at
    T = 16K on the H200 with unchanged bf16 error ratios."""
    return dtype != torch.float32


def _blocks(dk: int, dv: int):
    """(BK, BV, warps) of the node kernels: the whole key width, V in blocks of up to 64 (32 at K = 256)."""
    bk = pow2(dk)
    return bk, min(pow2(dv), 64 if bk <= 128 else 32), 4 if bk <= 128 else 8


def grads_split(dk: int, dv: int) -> tuple[bool, int]:
    """(split, warps) of the node form's gradient kernels (hilo_kernels.common.launch.loglinear_attn_grads_split)."""
    return loglinear_attn_grads_split(pow2(dk), pow2(dv))


def nodes_fwd(k, v, g, lay: LevelLayout, tab: NodeTables, rows: torch.Tensor | None = None, fp32: bool = False):
    """The node states [rows, H, K, V] (zero where no node is needed), or those of the listed rows only (in list
    order). With bf16 inputs they are stored in bf16, which is what every dot that reads them rounds
    them to anyway (half the bytes moved; fp16 keeps fp32 storage: a node sums up to half a sequence of k v^T and
    could overflow fp16's range); fp32 forces fp32 storage (the final states)."""
    h, dk, dv = k.shape[1], k.shape[2], v.shape[2]
    dtype = k.dtype if _node_lowp(k.dtype) and k.dtype == torch.bfloat16 and not fp32 else torch.float32
    count = lay.rows if rows is None else rows.numel()
    nodes = torch.empty(count, h, dk, dv, device=k.device, dtype=dtype)
    bk, bv, warps = _blocks(dk, dv)
    if count:
        _node_fwd[(triton.cdiv(dv, bv), count, h)](
            k, v, g if g is not None else k, nodes, lay.chunks, tab.info, rows if rows is not None else tab.info,
            H=h, K=dk, V=dv, C=CHUNK, BK=bk, BV=bv, HAS_G=g is not None, USE_LIST=rows is not None,
            LOWP=_node_lowp(k.dtype), PREC=dot_precision(k.dtype), num_warps=warps, num_stages=2)
    return nodes


def node_scan_fwd(q, k, v, g, lam, scale, lay: LevelLayout, o, store_final: bool):
    """o += the chunk-level reads (node form); returns the final chunk-level states [N, H, nj, K, V] fp32 or None."""
    h, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    tab = node_tables(lay)
    rf, _, a_end = gate_factors(g, lay, tab, h)
    nodes = nodes_fwd(k, v, g, lay, tab)
    bk, bv, warps = _blocks(dk, dv)
    _read_fwd[(triton.cdiv(dv, bv), lay.rows, h)](
        q, g if g is not None else q, lam, nodes, rf, tab.read_list, tab.n_read, o, lay.chunks, scale, lam.shape[-1],
        H=h, K=dk, V=dv, C=CHUNK, BK=bk, BV=bv, NJP=tab.njp, LEV0=7, HAS_G=g is not None, LOWP=_node_lowp(q.dtype),
        PREC=dot_precision(q.dtype), num_warps=warps, num_stages=2)
    rfin = None
    if store_final:
        final = nodes if nodes.dtype == torch.float32 else nodes_fwd(k, v, g, lay, tab, tab.final_list, fp32=True)
        rfin = final_from_nodes(final, lay, tab, a_end, listed=final is not nodes)
    return rfin


def _final_factors(lay: LevelLayout, tab: NodeTables, a_end, h: int):
    """[N, H, nj] fp32: exp(G_last - G_end(e)) for each sequence's final node of each chunk level (0: none)."""
    fr = tab.final_rows
    on = (fr >= 0)[:, None, :]
    if a_end is None:
        return on.float().expand(lay.n, h, lay.nj)
    last = torch.as_tensor(lay.last_rows, device=fr.device)
    fac = torch.exp(a_end[last][:, :, None] - a_end[fr.clamp(min=0)].transpose(1, 2))
    return torch.where(on, fac, 0.0).float()


def final_from_nodes(nodes, lay: LevelLayout, tab: NodeTables, a_end, listed: bool = False):
    """The final chunk-level states [N, H, nj, K, V] fp32 from the nodes (all rows', or those of tab.final_list)."""
    n, h = lay.n, nodes.shape[1]
    if nodes.shape[0] == 0:  # no sequence ends with a chunk-level state (e.g. one chunk after a prior)
        return nodes.new_zeros(n, h, lay.nj, *nodes.shape[2:], dtype=torch.float32)
    fac = _final_factors(lay, tab, a_end, h)
    index = tab.final_pos if listed else tab.final_rows.clamp(min=0)
    picked = nodes[index]  # [N, nj, H, K, V]
    return picked.transpose(1, 2) * fac[..., None, None]


def node_scan_bwd(qf, kf, vf, gf, lf, do, drfin, scale, lay: LevelLayout, dq, dk, dv, dlam):
    """The chunk-level parts of the backward (node form), given the intra kernel's dq, dk, dv, dlam (fp32): returns
    the whole dq, dk, dv in the input dtypes and dL/dG [TT, H] fp32 (None without a gate); dlam is added in place.
    The nodes are recomputed (keeping the forward's would hold 8 KiB per token per layer at H = 16, K = V = 128 in
    bf16)."""
    h, dk_, dv_ = qf.shape[1], qf.shape[2], vf.shape[2]
    tab = node_tables(lay)
    rf, wf, a_end = gate_factors(gf, lay, tab, h)
    nodes = nodes_fwd(kf, vf, gf, lay, tab)
    dnodes = torch.empty_like(nodes)
    bk, bv, warps = _blocks(dk_, dv_)
    prec = dot_precision(qf.dtype)
    gate = gf if gf is not None else qf
    nl = lf.shape[-1]
    _node_bwd[(triton.cdiv(dv_, bv), lay.rows, h)](
        qf, gate, lf, do, rf, dnodes, lay.chunks, tab.info, scale, nl, H=h, K=dk_, V=dv_, C=CHUNK, BK=bk, BV=bv,
        NJP=tab.njp, LEV0=7, HAS_G=gf is not None, LOWP=_node_lowp(qf.dtype), PREC=prec, num_warps=warps, num_stages=2)
    if drfin is not None:  # the final chunk-level states are the final nodes, decayed to the last token
        fac = _final_factors(lay, tab, a_end, h)  # [N, H, nj]
        part = (drfin.float() * fac[..., None, None]).transpose(1, 2)  # [N, nj, H, K, V], zero where no node
        # every (sequence, level) adds, the missing ones zeros into row 0: no boolean indexing (a host sync)
        dnodes.index_put_((tab.final_rows.clamp(min=0),), part.to(dnodes.dtype), accumulate=True)
    dq_out, dk_out, dv_out = torch.empty_like(qf), torch.empty_like(kf), torch.empty_like(vf)
    dbig_g = torch.empty(qf.shape[:2], device=qf.device, dtype=torch.float32) if gf is not None else None
    common = {"H": h, "K": dk_, "V": dv_, "C": CHUNK, "BK": bk, "BV": bv, "NJP": tab.njp, "HAS_G": gf is not None,
              "LOWP": _node_lowp(qf.dtype), "PREC": prec, "num_stages": current("loglinear_attn").node_stages}
    big_g = dbig_g if dbig_g is not None else dq
    split, split_warps = grads_split(dk_, dv_)
    if split:  # two kernels with half the live tiles each (more programs per SM)
        _grads_read[(lay.rows, h)](qf, gate, lf, do, nodes, rf, tab.read_list, tab.n_read, dq, dlam, dq_out, big_g,
                                   lay.chunks, scale, nl, lay.nj, LEV0=7, num_warps=split_warps, **common)
        _grads_write[(lay.rows, h)](kf, vf, gate, dnodes, wf, tab.write_list, tab.n_write, dk, dv, dk_out, dv_out,
                                    big_g, lay.chunks, num_warps=split_warps, **common)
    else:
        _grads[(lay.rows, h)](
            qf, kf, vf, gate, lf, do, nodes, dnodes, rf, wf, tab.read_list, tab.n_read, tab.write_list, tab.n_write,
            dq, dk, dv, dlam, dq_out, dk_out, dv_out, big_g, lay.chunks, scale, nl, lay.nj, LEV0=7,
            num_warps=8 if bk <= 128 else 16, **common)
    return dq_out, dk_out, dv_out, dbig_g
