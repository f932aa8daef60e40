"""Triton forward of log-linear attention: an intra-chunk kernel and one level-scan kernel (SPEC §4's fast form).

Chunks of C = 64 tokens are aligned to absolute positions, as in chunk.py: a sequence that starts at position p0
(after an initial state) has a first chunk of 64 - p0 mod 64 tokens. Tensors are viewed on one packed token axis
[B*T, H, D]; `LevelLayout` holds, built on the host from the bounds the validation already read, the per-sequence
table (bos, eos, p0) and the per-chunk table (base, lo, hi): tokens base .. base + 63 are in-chunk offsets 0..63,
of which lo .. hi - 1 are real. Two launches:

  1. `_intra_fwd`, one program per (V-block, chunk, head), all chunks in parallel, levels 0..6:
         o = scale * ((q k^T * exp(gc_t - gc_s) [s <= t]) * Lambda) v,   Lambda[t, s] = lambda_t[bit_length(t xor s)]
     with gc the in-chunk inclusive cumsum of g and t, s in-chunk offsets (Lambda built in-kernel).
  2. `_level_scan_fwd`, one program per (V-block, sequence, head, level group), walks the sequence's chunks in
     order and carries all chunk-level states of its group at once in one register tile R [K, NJ * BV] (level
     j = 1..NJ in columns (j - 1) * BV .. j * BV - 1; level 6 + j of SPEC's Fenwick hierarchy; one group holds up
     to OPTIONS["scan_levels"] = 8 levels, so up to T = 64 * 2^8 = 16384 one program carries every level).
     Chunk c (absolute index):
         reset level j if c mod 2^j == 0;
         o_t += sum_j [bit j-1 of c] lambda_t[6 + j] (scale exp(gc_t) q_t) R_j     (one tl.dot, then a sum over j)
         R <- exp(gl) R + [bit j-1 of c clear] (k * exp(gl - gc))^T v             (gl: the chunk's total log decay)
     The read is one tl.dot on the stacked tile (added to o with fp32 atomics: level groups share tokens); the
     write is one [K, BV] tl.dot copied into the written levels' columns. At the end it stores the final
     chunk-level states R_j * [bit j-1 of the last chunk set] (the levels 7.. of the final state).
Both accumulate in fp32 and write an fp32 output (the caller casts). NJ is a power of two (the last group of levels
is padded), so a handful of variants compile; nothing specialises on T.
The prior levels of an initial state and the final levels 0..6 are exact torch code around these kernels
(triton_bwd.loglinear_attn_triton).
"""

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.common.env_options import parse_flag, parse_int

from .state import CHUNK_LEVELS, level_of, prior_level

CHUNK = 1 << CHUNK_LEVELS
CHUNK_LEVELS_C = tl.constexpr(CHUNK_LEVELS)


# Tuning switches, read at every launch and overridable from the environment, e.g.
# HILO_LOGLINEAR="scan_cols=64,scan_warps=4,lowp=0". None changes anything for fp32 inputs but the tile shapes.
#   scan_cols:  columns of the stacked level tile R [K, NJ * BV] of the level scans (BV = scan_cols / NJ, 16..32).
#   scan_warps: warps per level-scan program (forward and backward); 0: 8, or 16 when the stacked tile holds more
#               than 16K values (K = 256, or scan_cols above 128).
#   scan_levels: most chunk levels one level-scan program carries (a power of two); more levels take more
#               programs (see LevelLayout.level_groups).
#   lowp:       16-bit inputs: loglinear_attn's level scans round their tl.dot operands to the input dtype (fp32
#               accumulation) instead of taking tf32 products of fp32 tiles. Off by default: Triton 3.6 on Hopper
#               miscompiled some 16-bit dots with narrow tiles in linear_attn (benchmarks/RESULTS.md), and these
#               scans have such tiles (N = BV < 64); turn it on where tests/kernels/test_gpu_bf16.py passes with it.
#   form:       "nodes" (triton_nodes: the chunk levels as a tree of node states, every chunk in parallel) or "scan"
#               (the level scans below, sequential over a sequence's chunks); loglinear_attn only.
#   node_lowp:  16-bit inputs: the node form's dots take 16-bit operands (node tiles rounded to the input dtype,
#               fp32 accumulation; every tile is at least 64 wide) instead of tf32 products of fp32 tiles. On by
#               default: 14.1 -> 10.2 ms fwd+bwd at T = 16K on the H200 with unchanged bf16 error ratios, and the
#               small-head GPU tests pass (benchmarks/RESULTS.md, session 4).
#   node_save:  the node form keeps its forward's nodes for the backward instead of recomputing them (one
#               [K, V] node per chunk row and head: 8 KiB per token per layer at H = 16, K = V = 128 in bf16).
#   node_grads_split: the node form's gradient kernel as two (reads: dq, dlambda; writes: dk, dv), each with half the
#               live tiles; node_grads_warps: their warps. Triton 3.6 AOT for sm_90, bf16, K = V = 128
#               (benchmarks/triton_resources.py): the fused kernel takes 255 registers and spills 32 B at 8 warps; the
#               halves 195 / 193 registers without spills at 8 warps (255 and spilling at 4). Unset (None, 0), both
#               follow the head size (triton_nodes.grads_split): split at 4 warps where K <= 128 and V <= 64, else one
#               kernel. H200, bf16 fwd+bwd at log-linear Mamba-2's heads (8K x 4, H = 32, K = 128, V = 64): 7.519 ms
#               split at 4 warps against 8.435 fused (8.638 split at 8 warps); loglinear_mamba2 340m compiled at 8K x
#               4: 87,784 tokens/s against 83,674 (s19_c.sh, s19_e.sh, s19_f.sh).
#   node_stages: software-pipelining stages of the node form's gradient kernel (its per-level loops).
#   scan_bwd_split: loglinear_attn's backward scan as two launches (forward recompute, then the reverse pass)
#               instead of one launch running both side by side: fewer registers per program (sm_90, K = V = 128:
#               spills 416 + 224 B instead of 776 B at one chunk level), half the programs in flight.
OPTIONS = {"scan_cols": 128, "scan_warps": 0, "scan_levels": 8, "lowp": False, "scan_bwd_split": False,
           "form": "nodes", "node_stages": 2, "node_lowp": True,
           "node_save": False, "node_grads_split": None, "node_grads_warps": 0}
FORMS = ("nodes", "scan")


def _apply_env_options():
    spec = os.environ.get("HILO_LOGLINEAR", "").strip()
    for item in filter(None, (x.strip() for x in spec.split(","))):
        key, _, val = item.partition("=")
        if key not in OPTIONS:
            raise ValueError(f"HILO_LOGLINEAR: unknown option {key!r}; expected one of {sorted(OPTIONS)}")
        if key == "form":
            if val.strip() not in FORMS:
                raise ValueError(f"HILO_LOGLINEAR: form={val.strip()!r}; expected one of {FORMS}")
            OPTIONS[key] = val.strip()
            continue
        flag = key in ("lowp", "scan_bwd_split", "node_lowp", "node_save", "node_grads_split")
        OPTIONS[key] = parse_flag("HILO_LOGLINEAR", key, val) if flag else parse_int("HILO_LOGLINEAR", key, val)


_apply_env_options()


def scan_warps(bk: int, cols: int) -> int:
    """Warps of a level-scan program whose stacked tile is [bk, cols] (OPTIONS["scan_warps"] unless 0)."""
    if OPTIONS["scan_warps"]:
        return OPTIONS["scan_warps"]
    return 16 if bk * cols > 16384 else 8


def lowp(dtype: torch.dtype) -> bool:
    """Whether the level scans round their dot operands to a 16-bit input dtype."""
    return dtype != torch.float32 and bool(OPTIONS["lowp"])


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
        j0, stacked states NJ, programs along the group axis): groups of OPTIONS["scan_levels"] // shrink (a power of
        two), then the rest padded to a power of two. Levels evolve independently, so a group's programs carry only
        their own levels (and their reads add atomically): nj = 9 is 8 + 1 stacked levels, not 16."""
        size = max(OPTIONS["scan_levels"] // shrink, 1)
        full, rest = divmod(self.nj if count is None else count, size)
        out = [(0, size, full)] if full else []
        if rest:
            out.append((full * size, triton.next_power_of_2(rest), 1))
        return out

    @staticmethod
    def scan_block_v(dv: int, stacked: int, shrink: int = 1, cols: int | None = None) -> int:
        """V-block of a level scan whose stacked tile R is [K, stacked * BV]: stacked * BV about
        cols (OPTIONS["scan_cols"] unless given) // shrink columns, BV in 16..32."""
        # tl.dot needs every dimension >= 16, and the write's [K, BV] dot has N = BV
        return min(max((cols or OPTIONS["scan_cols"]) // shrink // stacked, 16), 32, pow2(dv))


def tile_shrink(bk: int, power: int) -> int:
    """How much narrower the stacked tile of a K-wide level scan must be than at K <= 128 for shared memory
    (227 KiB on sm_90): (bk / 128)^power, power 1 for loglinear_attn's scans, 2 for the delta rule's (checked by
    compiling for sm_90 at K = 256 with Triton 3.6, the GPU image's version, by benchmarks/triton_resources.py:
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
def _scan_chunk(q, k, g, lam, bos, eos, base, c, i_h, o_k, col_j, j0, scale, NL,
                H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, NJ: tl.constexpr, BV: tl.constexpr,
                HAS_G: tl.constexpr):
    """Per-chunk pieces of the level scans: tokens, masks, the q and k tiles as loaded with their row factors
    q_scale = scale exp(gc) (q_eff = q_scale * q) and k_scale = exp(gl - gc) (kd = k_scale * k), which the kernels put
    on the narrow [C, BV] / [C, NJ * BV] operands instead of scaling the [C, K] tiles (fewer live registers), the
    chunk's decay exp(gl), the per-column read weights lambda_t[6 + j] [bit j-1 of c] and the masks keep (level j
    survives: c mod 2^j != 0) and read (bit j-1 of c); col_j = j - 1 per column, levels j0 + 1 .. j0 + NJ."""
    o_t = base + tl.arange(0, C)
    m_t = (o_t >= bos) & (o_t < eos)
    m_tk = m_t[:, None] & (o_k[None, :] < K)
    qb = tl.load(q + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
    kb = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
    if HAS_G:
        gb = tl.load(g + o_t * H + i_h, mask=m_t, other=0.0).to(tl.float32)
        gc = tl.cumsum(gb, 0)
        gl = tl.sum(gb, 0)
        q_scale = tl.exp(gc) * scale
        k_scale = tl.exp(gl - gc)
        decay = tl.exp(gl)
    else:
        q_scale = tl.full([C], scale, tl.float32)
        k_scale = tl.full([C], 1.0, tl.float32)
        decay = 1.0
    keep = (c % (2 << col_j)) != 0
    read = ((c >> col_j) & 1) == 1
    o_j = j0 + tl.arange(0, NJ)
    lev = CHUNK_LEVELS_C + 1 + o_j
    w = tl.load(lam + (o_t[:, None] * H + i_h) * NL + lev[None, :],
                mask=m_t[:, None] & ((lev < NL) & (((c >> o_j) & 1) == 1))[None, :], other=0.0).to(tl.float32)
    return o_t, m_t, qb, kb, q_scale, k_scale, decay, keep, read, _spread_levels(w, C, NJ, BV)


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


@triton.jit(do_not_specialize=["NL", "J0", "NJT"])
def _level_scan_fwd(q, k, v, g, lam, o, rfin, seqs, scale, NL, J0, NJT,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, NJ: tl.constexpr, HAS_G: tl.constexpr, STORE_FINAL: tl.constexpr,
                    LOWP: tl.constexpr, PREC: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    j0 = J0 + tl.program_id(2) * NJ  # this program's levels: j0 + 1 .. j0 + NJ
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(seqs + i_n * 3).to(tl.int64)
    eos = tl.load(seqs + i_n * 3 + 1).to(tl.int64)
    p0 = tl.load(seqs + i_n * 3 + 2).to(tl.int64)
    front = p0 % C
    nchunks = (front + eos - bos + C - 1) // C
    o_k = tl.arange(0, BK)
    cols = tl.arange(0, NJ * BV)
    col_j = j0 + cols // BV  # level j - 1 of each column
    col_v = i_v * BV + cols % BV
    m_col = col_v < V
    o_v = i_v * BV + tl.arange(0, BV)
    state = tl.zeros([BK, NJ * BV], dtype=tl.float32)
    for i in range(nchunks):
        c = p0 // C + i
        o_t, m_t, qb, kb, q_scale, k_scale, decay, keep, read, w = _scan_chunk(
            q, k, g, lam, bos, eos, bos - front + i * C, c, i_h, o_k, col_j, j0, scale, NL, H, K, C, NJ, BV, HAS_G)
        state = tl.where(keep[None, :], state, 0.0)
        inter = _sum_levels(_mm(qb, state, q, LOWP, PREC) * (w * q_scale[:, None]), C, NJ, BV)
        m_tv = m_t[:, None] & (o_v[None, :] < V)
        _accumulate(o + (o_t[:, None] * H + i_h) * V + o_v[None, :], inter, m_tv)
        vb = tl.load(v + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        local = _mm(tl.trans(kb), vb * k_scale[:, None], q, LOWP, PREC)
        state = state * decay + tl.where(read[None, :], 0.0, _tile_levels(local, BK, NJ, BV))
    if STORE_FINAL:
        c_last = (p0 + eos - bos - 1) // C
        on = (((c_last >> col_j) & 1) == 1) & (nchunks > 0)
        ptr = rfin + ((i_nh.to(tl.int64) * NJT + col_j[None, :]) * K + o_k[:, None]) * V + col_v[None, :]
        tl.store(ptr, tl.where(on[None, :], state, 0.0), mask=(o_k[:, None] < K) & (m_col & (col_j < NJT))[None, :])


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


def level_scan_fwd(q, k, v, g, lam, scale, lay: LevelLayout, o, store_final: bool):
    """o += the chunk-level reads; returns the final chunk-level states [N, H, nj, K, V] fp32 (or None)."""
    h, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    rfin = torch.empty(lay.n, h, lay.nj, dk, dv, device=q.device, dtype=torch.float32) if store_final else None
    shrink = tile_shrink(pow2(dk), 1)
    for j0, nj, groups in lay.level_groups(shrink=shrink):
        bv = lay.scan_block_v(dv, nj, shrink)
        _level_scan_fwd[(triton.cdiv(dv, bv), lay.n * h, groups)](
            q, k, v, g if g is not None else q, lam, o, rfin if rfin is not None else o, lay.seqs, scale,
            lam.shape[-1], j0, lay.nj, H=h, K=dk, V=dv, C=CHUNK, BK=pow2(dk), BV=bv, NJ=nj, HAS_G=g is not None,
            STORE_FINAL=store_final, LOWP=lowp(q.dtype), PREC=dot_precision(q.dtype),
            num_warps=scan_warps(pow2(dk), nj * bv), num_stages=1)
    return rfin
