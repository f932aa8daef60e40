"""Triton forward of log-linear attention's intra-chunk part, and the chunk layout and level-scan helpers that
triton_nodes and loglinear_delta_rule's level scans share (the fast form of docs/kernels.md).

Chunks of C = 64 tokens are aligned to absolute positions, as in chunk.py: a sequence that starts at position p0
(after an initial state) has a first chunk of 64 - p0 mod 64 tokens. Tensors are viewed on one packed token axis
[B*T, H, D]; `LevelLayout` holds, built on the host from the bounds the validation already read, the per-sequence
table (bos, eos, p0) and the per-chunk table (base, lo, hi): tokens base .. base + 63 are in-chunk offsets 0..63,
of which lo .. hi - 1 are real.

`_intra_fwd`, one program per (V-block, chunk, head), all chunks in parallel, levels 0..6:
    o = scale * ((q k^T * exp(gc_t - gc_s) [s <= t]) * Lambda) v,   Lambda[t, s] = lambda_t[bit_length(t xor s)]
with gc the in-chunk inclusive cumsum of g and t, s in-chunk offsets (Lambda built in-kernel). It accumulates in
fp32 and writes an fp32 output (the caller casts). The chunk levels 7.. go through triton_nodes (a tree of node
states, every chunk in parallel); the prior levels of an initial state and the final levels 0..6 are exact torch
code around these kernels (triton_bwd.loglinear_attn_triton).
A level scan (loglinear_delta_rule's) carries a group of up to scan_levels (8) chunk levels at once in one stacked
register tile R [K, NJ * BV], so up to T = 64 * 2^8 = 16384 one program carries every level; LevelLayout's
level_groups and scan_block_v size those launches (hilo_kernels.common.launch's LogLinearDeltaRule settings).
"""

import functools

import torch
import triton
import triton.language as tl

from hilo_kernels.common.launch import current

from .state import CHUNK_LEVELS, level_of, prior_level

CHUNK = 1 << CHUNK_LEVELS
CHUNK_LEVELS_C = tl.constexpr(CHUNK_LEVELS)


def scan_warps(bk: int, cols: int) -> int:
    """Warps of a level-scan program (loglinear_delta_rule's) whose stacked tile is [bk, cols]: the scan_warps launch
    setting where set, else 8, or 16 when the stacked tile holds more than 16K values (K = 256, or wide budgets)."""
    chosen = current("loglinear_delta_rule").scan_warps
    if chosen:
        return chosen
    return 16 if bk * cols > 16384 else 8


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full fp32 ("ieee": tf32 would miss the 1e-4 fp32 tolerance); 16-bit inputs tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def pow2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(max(int(x), 1)))


class LevelLayout:
    """Sequences and chunks of a call on the packed axis, and the chunk-level count (host-built, then on device).

    seqs int32 [N, 3] (bos, eos, p0); chunks int32 [rows, 3] (base, lo, hi); nj the chunk levels reached
    (max over sequences of bit_length(last chunk index)); seq_of_token int64 [B*T] (on device). For chunk-major
    tensors ([rows, C, ...], the delta rule's per-chunk pieces): seq_chunks int32 [N, 3] (first row, chunk count,
    absolute index of the first chunk), row_chunk int32 [rows] (each row's absolute chunk index) and chunk_pos int64
    [B*T], each token's flat index row * C + offset."""

    def __init__(self, segs, starts, t: int, device):
        self.n = len(segs)
        seq_rows, chunk_rows, seq_chunks, positions, row_chunk, nj = [], [], [], [], [], 0
        self.last_tokens, self.nonempty, self.first_rows, self.chunk_counts = [], [], [], []
        for (row, s, e), p0 in zip(segs, starts):
            bos, eos = row * t + s, row * t + e
            seq_rows.append((bos, eos, p0))
            front = p0 % CHUNK
            nchunks = -(-(front + eos - bos) // CHUNK)
            seq_chunks.append((len(chunk_rows), nchunks, p0 // CHUNK))
            self.first_rows.append(len(chunk_rows))
            self.chunk_counts.append(nchunks)
            positions.append(torch.arange(eos - bos, dtype=torch.int64) + len(chunk_rows) * CHUNK + front)
            for i in range(nchunks):
                base = bos - front + i * CHUNK
                chunk_rows.append((base, max(base, bos), min(base + CHUNK, eos)))
                row_chunk.append(p0 // CHUNK + i)
            if eos > bos:
                nj = max(nj, ((p0 + eos - bos - 1) // CHUNK).bit_length())
            self.last_tokens.append(max(eos - 1, 0))
            self.nonempty.append(eos > bos)
        self.seqs = torch.tensor(seq_rows, dtype=torch.int32).reshape(-1, 3).to(device)
        self.chunks = torch.tensor(chunk_rows, dtype=torch.int32).reshape(-1, 3).to(device)
        self.seq_chunks = torch.tensor(seq_chunks, dtype=torch.int32).reshape(-1, 3).to(device)
        self.chunk_pos = torch.cat(positions).to(device)
        self.row_chunk = torch.tensor(row_chunk, dtype=torch.int32).to(device)  # each row's chunk index c
        self.rows = len(chunk_rows)
        self.nj = nj
        lengths = torch.tensor([e - s for _, s, e in segs], dtype=torch.int64)
        ids = torch.repeat_interleave(torch.arange(self.n, dtype=torch.int64), lengths)
        # rows of a [B, T] batch are all covered (no gaps), so token order == sequence order
        self.seq_of_token = ids.to(device)
        self.last_of_seq = torch.tensor(self.last_tokens, dtype=torch.int64, device=device)
        self.nonempty_mask = torch.tensor(self.nonempty, dtype=torch.bool, device=device)
        self.first_tokens = torch.tensor([bos for bos, _, _ in seq_rows], dtype=torch.int64, device=device)
        self.starts = list(starts)
        self.lengths = lengths.tolist()
        # in-chunk offset of each sequence's last token and its last chunk row (0 for an empty sequence)
        self.end_offsets = torch.tensor([(p0 + n - 1) % CHUNK if n else 0 for p0, n in zip(starts, self.lengths)],
                                        dtype=torch.int64, device=device)
        self.last_rows = torch.tensor([r + c - 1 if c else 0 for r, c in zip(self.first_rows, self.chunk_counts)],
                                      dtype=torch.int64, device=device)

    def prior_moves(self, nl: int, device) -> torch.Tensor:
        """[N, L, L] fp32: prior level l lands in level max(l, bit_length(last xor (p0 - 1))) of the final state
        (the identity for a sequence without tokens; zero without a prior, p0 == 0, whose levels are not read)."""
        moves = torch.zeros(self.n, nl, nl)
        for n, (p0, length) in enumerate(zip(self.starts, self.lengths)):
            if p0 > 0 and length > 0:
                idx = prior_level(torch.tensor([p0 + length - 1]), p0, nl)[0]
                moves[n, torch.arange(nl), idx] = 1.0
            elif p0 > 0:
                moves[n] = torch.eye(nl)
        return moves.to(device)

    def level_groups(self, count: int | None = None, shrink: int = 1) -> list[tuple[int, int, int]]:
        """Launches of a level scan over `count` stacked states (the nj chunk levels unless given) as (first index
        j0, stacked states NJ, programs along the group axis): groups of the scan_levels setting // shrink (a power of
        two), then the rest padded to a power of two. Levels evolve independently, so a group's programs carry only
        their own levels (and their reads add atomically): nj = 9 is 8 + 1 stacked levels, not 16."""
        size = max(current("loglinear_delta_rule").scan_levels // shrink, 1)
        full, rest = divmod(self.nj if count is None else count, size)
        out = [(0, size, full)] if full else []
        if rest:
            out.append((full * size, triton.next_power_of_2(rest), 1))
        return out

    @staticmethod
    def scan_block_v(dv: int, stacked: int, shrink: int = 1, cols: int | None = None) -> int:
        """V-block of a level scan whose stacked tile R is [K, stacked * BV]: stacked * BV about
        cols (the scan_cols setting, 128 by default, unless given) // shrink columns, BV in 16..32."""
        # tl.dot needs every dimension >= 16, and the write's [K, BV] dot has N = BV
        return min(max((cols or current("loglinear_delta_rule").scan_cols or 128) // shrink // stacked, 16), 32,
                   pow2(dv))


def tile_shrink(bk: int, power: int) -> int:
    """How much narrower the stacked tile of a K-wide level scan must be than at K <= 128 for shared memory
    (227 KiB on sm_90): (bk / 128)^power, power 1 for loglinear_attn's scans, 2 for the delta rule's (checked by
    compiling for sm_90 at K = 256 with Triton 3.6 ahead of time:
    130 KiB for loglinear_attn's backward scan in bf16, 208 KiB in fp32 and for the delta rule's backward scan)."""
    return (max(bk, 128) // 128) ** power


def last_chunk_levels(kd, v, lay: LevelLayout, nl: int) -> torch.Tensor:
    """Levels 0..6 of the final state from each sequence's last chunk, [N, H, L, K, V] fp32 (zero above 6):
    level l = sum over the chunk's tokens s at level l from the last token of kd_s v_s^T. kd [N, C, H, K] (keys
    already moved to the last token, zero where not a real token of the chunk), v [N, C, H, V] (torch,
    differentiable)."""
    n, c, h, dk = kd.shape
    dv = v.shape[-1]
    nin = min(nl, CHUNK_LEVELS + 1)
    offs = torch.arange(c, device=kd.device)
    lev = level_of(lay.end_offsets[:, None], offs[None, :])  # [N, C]
    onehot = (lev[..., None] == torch.arange(nin, device=kd.device)).float()  # [N, C, nin]
    per_level = torch.einsum("ncl,nchk->nhlkc", onehot, kd).reshape(n, h, nin * dk, c)
    out = (per_level @ v.permute(0, 2, 1, 3)).reshape(n, h, nin, dk, dv)
    return torch.nn.functional.pad(out, (0, 0, 0, 0, 0, nl - nin))


@functools.lru_cache(maxsize=16)
def level_layout(segs: tuple, starts: tuple, t: int, device: torch.device) -> LevelLayout:
    """LevelLayout, cached: every layer of a model (and every step of a fixed-shape run) sees the same documents,
    so the host-side tables are built and copied to the device once."""
    return LevelLayout(segs, starts, t, device)


@triton.jit
def _chunk_rows(chunks, i_c):
    """(base, lo, hi) of chunk row i_c: tokens base + 0..63 are in-chunk offsets 0..63, real in [lo, hi)."""
    base = tl.load(chunks + i_c * 3).to(tl.int64)
    lo = tl.load(chunks + i_c * 3 + 1).to(tl.int64)
    hi = tl.load(chunks + i_c * 3 + 2).to(tl.int64)
    return base, lo, hi


@triton.jit
def _in_chunk_levels(C: tl.constexpr):
    """[C, C] int32 bit_length(t xor s) of in-chunk offsets (C <= 64, so levels 0..6)."""
    o_i = tl.arange(0, C)
    x = o_i[:, None] ^ o_i[None, :]
    lev = (x >= 1).to(tl.int32)
    for b in tl.static_range(1, 6):
        lev += (x >= (1 << b)).to(tl.int32)
    return lev


@triton.jit
def _in_chunk_lambda(lam, o_t, m_t, i_h, lev, NL, H: tl.constexpr, C: tl.constexpr):
    """Lambda[t, s] = lambda_t[lev[t, s]] for levels 0..6 (levels >= NL never occur on real pairs)."""
    out = tl.zeros([C, C], dtype=tl.float32)
    for lv in tl.static_range(0, 7):
        lam_l = tl.load(lam + (o_t * H + i_h) * NL + lv, mask=m_t & ((tl.zeros_like(o_t) + lv) < NL), other=0.0).to(tl.float32)
        out = tl.where(lev == lv, lam_l[:, None], out)
    return out


@triton.jit(do_not_specialize=["NL"])
def _intra_fwd(q, k, v, g, lam, o, chunks, scale, NL,
               H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, HAS_G: tl.constexpr, PREC: tl.constexpr):
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    base, lo, hi = _chunk_rows(chunks, i_c)
    o_t = base + tl.arange(0, C)
    m_t = (o_t >= lo) & (o_t < hi)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_tk = m_t[:, None] & (o_k[None, :] < K)
    m_tv = m_t[:, None] & (o_v[None, :] < V)
    qb = tl.load(q + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
    kb = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
    scores = tl.dot(qb, tl.trans(kb), input_precision=PREC)
    o_i = tl.arange(0, C)
    causal = o_i[:, None] >= o_i[None, :]
    if HAS_G:
        gc = tl.cumsum(tl.load(g + o_t * H + i_h, mask=m_t, other=0.0).to(tl.float32), 0)
        scores *= tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
    lev = _in_chunk_levels(C)
    scores = tl.where(causal, scores, 0.0) * _in_chunk_lambda(lam, o_t, m_t, i_h, lev, NL, H, C) * scale
    vb = tl.load(v + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0)
    acc = tl.dot(scores.to(vb.dtype), vb, input_precision=PREC)
    tl.store(o + (o_t[:, None] * H + i_h) * V + o_v[None, :], acc, mask=m_tv)


@triton.jit
def _spread_levels(w, R: tl.constexpr, S: tl.constexpr, BV: tl.constexpr):
    """[R, S] -> [R, S * BV]: each level's value in all of its BV columns."""
    return tl.reshape(tl.broadcast_to(w[:, :, None], [R, S, BV]), [R, S * BV])


@triton.jit
def _accumulate(ptr, val, mask):
    """*ptr += val with fp32 atomics; relaxed: only the sum matters, no ordering with other memory."""
    tl.atomic_add(ptr, val, mask=mask, sem="relaxed")


@triton.jit
def _mm(a, b, ref, LOWP: tl.constexpr, PREC: tl.constexpr):
    """a @ b with fp32 accumulation; LOWP: operands rounded to ref's (16-bit input) dtype first, for the fast MMA."""
    if LOWP:
        return tl.dot(a.to(ref.dtype.element_ty), b.to(ref.dtype.element_ty))
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _tile_levels(x, BK: tl.constexpr, S: tl.constexpr, BV: tl.constexpr):
    """[BK, BV] -> [BK, S * BV]: the same block in every stacked level's columns."""
    return tl.reshape(tl.broadcast_to(x[:, None, :], [BK, S, BV]), [BK, S * BV])


@triton.jit
def _sum_levels(x, R: tl.constexpr, S: tl.constexpr, BV: tl.constexpr):
    """[R, S * BV] -> [R, BV]: the sum over the stacked levels."""
    return tl.sum(tl.reshape(x, [R, S, BV]), 1)


def intra_fwd(q, k, v, g, lam, scale, lay: LevelLayout, o):
    """o [TT, H, V] fp32 <- the levels 0..6 part (q, k [TT, H, K], v [TT, H, V], g [TT, H] or None, lam
    [TT, H, L] fp32, all contiguous)."""
    h, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    if lay.rows == 0:
        return
    # Triton 3.6 on Hopper miscompiles [C, C] @ [C, BV] after a [C, BK] @ [BK, C] in bf16 when the V tile is under
    # 64 wide and narrower than the K tile (output error ratio ~1 at K, V = 32/64/128, 16 and 64, 32 on the H200,
    # 2026-11-29; the same class as linear_attn's output kernel). The V tile is widened to min(BK, 64); the extra
    # columns are masked.
    bv = min(64, max(pow2(dv), pow2(dk)))
    _intra_fwd[(triton.cdiv(dv, bv), lay.rows, h)](
        q, k, v, g if g is not None else q, lam, o, lay.chunks, scale, lam.shape[-1], H=h, K=dk, V=dv, C=CHUNK,
        BK=pow2(dk), BV=bv, HAS_G=g is not None, PREC=dot_precision(q.dtype), num_warps=4, num_stages=2)
