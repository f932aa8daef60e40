"""Triton forward of the gated delta rule (chunk 64, WY/UT representation; the math is in chunk.py's docstring).

Tensors are viewed as one packed token axis: [B, T, H, D] -> [B*T, H, D] with document boundaries `bounds`
(cu_seqlens, or b*T for fixed-length batches), so fixed-length and varlen inputs share one code path. Three
launches:
  1. prepare (one program per (chunk, head)): gamma (in-chunk cumsum of g), T = (I + A)^{-1} in fp32 by
     blocks of 16 (forward substitution on the diagonal blocks), W = T diag(beta e^gamma) K, U~ = T diag(beta) V;
  2. state pass (one program per (document, head, V-block)): walks the document's chunks in order, storing the
     chunk-start state S and the pseudo-values U = U~ - W S, then S <- e^{gamma_C} S + (e^{gamma_C-gamma} K)^T U;
  3. output (one program per (chunk, head, V-block)): O = scale (diag(e^gamma) Q S + (Q K^T * Gamma * M) U).
Chunk-start states are stored in the input dtype (fp32 inputs: fp32), accumulated in fp32. With OPTIONS
output_in_state (below) the state pass writes O itself and launch 3 is skipped.
"""

import os

import torch
import triton
import triton.language as tl

from kernels.common.env_options import parse_flag, parse_int
from kernels.common.gpu import multiprocessors

CHUNK = 64

# Build switches, read at every launch (so benchmarks/delta_rule_variants.py can compare them in one process), and
# overridable from the environment: HILO_DELTA_RULE="lowp_bwd=0,fused_bwd=0,state_bv_min=32". None of them changes
# anything for fp32 inputs except the fused backward (same math, fewer launches).
#   lowp_bwd:     16-bit inputs: the backward's dot operands in the input dtype (fp32 accumulation) and its large
#                 intermediates (dU, dW, partial dk) stored in the input dtype instead of fp32 / tf32.
#   prepare_mode: 16-bit inputs: how the forward's prepare kernel forms W = T X and U~ = T Y (T itself is always
#                 solved in fp32): 0 tf32 products of fp32 tiles (the first build); 1 T and X, Y rounded to the input
#                 dtype (as fla does; adds a bf16 rounding to W and U~); 2 T diag(.) split into hi + lo input-dtype
#                 parts against the exact K, V tiles (two 16-bit products, more accurate than tf32).
#   fused_bwd:    one chunk-parallel backward kernel (grads) instead of grads_qk + grads_wy: dW, partial dk and
#                 dgamma never go through HBM, and dA = -dY U^T needs no pass over W (see triton_bwd).
#   state_bv_min: smallest V-block of the sequential state passes when the (sequence, head) pairs do not fill
#                 the GPU; 0 (default) picks it by K: 16 up to K = 128 (up to 8 programs per pair at V = 128:
#                 5.69 ms fwd+bwd at T = 32K, B = 1, H = 16 against 5.98 with 32, 2026-11-29), 32 past it (Gated
#                 DeltaNet's K = 256, V = 512 at B = 2, T = 16K, H = 3: 4.26 ms against 5.48 with 16, session 13:
#                 a [256, 16] tile's pass does too little work per load of its [C, 256] key tiles).
#   intra_in_state_bwd: 0 the intra kernel writes dU_intra = scale P^T dO for the reverse state pass; 1 the reverse
#                 pass forms it itself (one launch and one [L, H, V] round trip less, more work per sequential
#                 step); 2 auto: 1 when the pass needs no V split to fill the GPU, else 0.
#   output_in_state: the same choice for the forward's output O: 0 separate output kernel, 1 written by the state
#                 pass, 2 auto (as intra_in_state_bwd).
# Defaults 0 for the last two: compiled for sm_90 (Triton 3.9, ptxas via cuobjdump --dump-resource-usage) the state
# passes already use 255 registers and the fused variants spill 2-3x more (state BV=64: 992 -> 2112 bytes of stack at
# 4 warps; state_bwd BV=64: 320 -> 616 at 8 warps); benchmarks/delta_rule_variants.py measures both.
#   state_scale_v: the state passes put per-token decays (and scale) on their [C, BV] tiles (U in the forward, dO
#                 in the backward) rather than on [C, K] tiles of K and Q, which then feed the products as loaded:
#                 fewer registers (sm_90, Triton 3.9: forward state at BV 64 spills 96 B instead of 992 B per thread,
#                 state_bwd 32 B instead of 320 B). Same rounding class (one 16-bit rounding of a scaled tile).
#   wide_stages:  software-pipelining stages of the state passes at K > 128 and V-blocks <= 32 for 16-bit inputs
#                 (state_stages): 2 (the next chunk's [C, K] tiles load during this chunk's products) or 1 (no
#                 pipelining). AOT for sm_90, Triton 3.6, bf16, K = 256: with 2 stages the forward / backward
#                 passes take 144 / 207 KB of shared memory at BV = 16 and 156 / 218 KB at BV = 32, no spills but
#                 64 B in the backward at 32; at BV = 64 the backward would need 238 KB, over sm_90's 227, so wider
#                 blocks keep 1 stage, and so does fp32 (its backward at BV = 16 needs 267 KB: on the H200 the fp32
#                 K = 256 GPU test failed with 2 stages there). Gated DeltaNet's few (sequence, head) pairs get
#                 BV 16-32 on the H200: at its 340m heads (B = 2, T = 16K, H = 3, K = 256, V = 512, bf16) fwd+bwd
#                 6.40 ms against 6.64 with 1 stage (session 11, RESULTS.md), every other delta_rule GPU test passing.
#   grads_warps, grads_stages, grads_maxnreg: the fused backward kernel's launch (0: NUM_WARPS / NUM_STAGES below,
#                 no register cap). At 8 warps it took 182 registers a thread at K = 256, V = 512 (sm_90, Triton 3.6,
#                 bf16), one program an SM; a 128-register cap measured slower than 4 warps (session 12).
#   state_warps, state_bwd_warps: warps of the sequential state passes (0: NUM_WARPS, 4 and 8), for sweeps: the two
#                 passes take 41 of Gated DeltaNet 340m's 306 kernel-ms a compiled 8K step (session 12).
OPTIONS = {"lowp_bwd": True, "prepare_mode": 2, "fused_bwd": True, "state_bv_min": 0, "intra_in_state_bwd": 0,
           "output_in_state": 0, "state_scale_v": True, "wide_stages": 2, "grads_warps": 0, "grads_stages": 0,
           "grads_maxnreg": 0, "state_warps": 0, "state_bwd_warps": 0}
_WARPS_OPTIONS = ("grads_warps", "state_warps", "state_bwd_warps")


def _apply_env_options():
    spec = os.environ.get("HILO_DELTA_RULE", "").strip()
    for item in filter(None, (x.strip() for x in spec.split(","))):
        key, _, val = item.partition("=")
        if key not in OPTIONS:
            raise ValueError(f"HILO_DELTA_RULE: unknown option {key!r}; expected one of {sorted(OPTIONS)}")
        ints = ("state_bv_min", "prepare_mode", "intra_in_state_bwd", "output_in_state", "wide_stages",
                "grads_stages", "grads_maxnreg", *_WARPS_OPTIONS)
        if key in _WARPS_OPTIONS and val.strip() not in ("0", "1", "2", "4", "8", "16"):
            raise ValueError(f"HILO_DELTA_RULE: {key}={val!r}: expected 0 (the default) or 1, 2, 4, 8 or 16 warps")
        OPTIONS[key] = parse_int("HILO_DELTA_RULE", key, val) if key in ints else parse_flag("HILO_DELTA_RULE", key, val)


_apply_env_options()


def lowp(dtype: torch.dtype, option: str) -> bool:
    """Whether a 16-bit path is on for inputs of `dtype` (never for fp32)."""
    return dtype != torch.float32 and bool(OPTIONS[option])
# Warps per program of each launch (forward and backward), chosen on an H200 at K = V = 128. The fused backward
# ("grads") at 4 warps and 3 stages (session 12, bf16 fwd+bwd at 16K x 2): 5.45 ms against 6.49 with 8 warps and 2
# stages at GDN 340m's heads (H = 3, K = 256, V = 512), 4.38 against 5.90 at H = 16, K = V = 128.
NUM_WARPS = {"prepare": 4, "state": 4, "output": 4, "intra": 4, "state_bwd": 8, "grads_qk": 8, "grads_wy": 8,
             "grads": 4}
NUM_STAGES = {"grads_qk": 3, "grads_wy": 2, "grads": 3}
# Tiles of the fused backward kernel (upper bounds; powers of two >= 16): its K-block, the V-block of its first pass
# (dP, dY, dA) and of its inner pass per K-block (dq, dW, state terms).
# 32/32/32: 220 registers and no spill at 8 warps on sm_90 (Triton 3.9); 64/64/32 spilled 112 bytes per thread.
GRADS_BLOCKS = {"kb": 32, "bv": 32, "bv2": 32}
# V-block of the sequential state passes when N * H fills the GPU; with fewer (sequence, head) pairs than
# multiprocessors (long single sequences) the passes take 32-wide V-blocks, twice the programs in flight.
STATE_BV = {"state": 64, "state_bwd": 64}


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (SPEC §2 tolerances); 16-bit inputs let fp32 tiles use tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _load_block(blk, r16, lim, bi: tl.constexpr, bj: tl.constexpr, H: tl.constexpr, C: tl.constexpr):
    """Block (bi, bj) of 16 x 16 of a chunk's [C, C] matrix stored row-major per token at `blk`."""
    return tl.load(blk + (16 * bi) * H * C + 16 * bj, mask=(16 * bi + r16 < lim)[:, None], other=0.0)


@triton.jit
def _store_block(blk, r16, lim, bi: tl.constexpr, bj: tl.constexpr, x, H: tl.constexpr, C: tl.constexpr):
    tl.store(blk + (16 * bi) * H * C + 16 * bj, x, mask=(16 * bi + r16 < lim)[:, None])


@triton.jit
def _inv_diag_blocks(blk, row0, r16, lim, H: tl.constexpr, C: tl.constexpr):
    """(I + A_bb)^{-1} for the four strictly lower 16 x 16 diagonal blocks of A (stored at `blk`).

    X = T - I solves X = N + N X with N = -A_bb, row by row: row i needs only rows < i, already final, and row i
    of N is read from memory (`row0` points at the chunk's first row). The four blocks are independent chains,
    interleaved for instruction-level parallelism.
    """
    x0 = -_load_block(blk, r16, lim, 0, 0, H, C)
    x1 = -_load_block(blk, r16, lim, 1, 1, H, C)
    x2 = -_load_block(blk, r16, lim, 2, 2, H, C)
    x3 = -_load_block(blk, r16, lim, 3, 3, H, C)
    for i in range(1, 16):
        sel = r16[:, None] == i
        n0 = -tl.load(row0 + i * H * C + r16, mask=r16 * 0 + i < lim, other=0.0)
        n1 = -tl.load(row0 + (16 + i) * H * C + 16 + r16, mask=r16 * 0 + 16 + i < lim, other=0.0)
        n2 = -tl.load(row0 + (32 + i) * H * C + 32 + r16, mask=r16 * 0 + 32 + i < lim, other=0.0)
        n3 = -tl.load(row0 + (48 + i) * H * C + 48 + r16, mask=r16 * 0 + 48 + i < lim, other=0.0)
        x0 = tl.where(sel, (n0 + tl.sum(n0[:, None] * x0, 0))[None, :], x0)
        x1 = tl.where(sel, (n1 + tl.sum(n1[:, None] * x1, 0))[None, :], x1)
        x2 = tl.where(sel, (n2 + tl.sum(n2[:, None] * x2, 0))[None, :], x2)
        x3 = tl.where(sel, (n3 + tl.sum(n3[:, None] * x3, 0))[None, :], x3)
    eye = (r16[:, None] == r16[None, :]).to(tl.float32)
    return x0 + eye, x1 + eye, x2 + eye, x3 + eye


@triton.jit
def _dot3(a, b, c, PREC: tl.constexpr):
    return tl.dot(a, tl.dot(b, c, input_precision=PREC), input_precision=PREC)


@triton.jit
def _prepare_kernel(
    k_ptr, v_ptr, beta_ptr, g_ptr, table_ptr,
    gamma_ptr, tinv_ptr, w_ptr, ut_ptr,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr,
    HAS_G: tl.constexpr, PREC: tl.constexpr, MODE: tl.constexpr,
):
    pid_c = tl.program_id(0)
    pid_h = tl.program_id(1)
    start = tl.load(table_ptr + pid_c * 3).to(tl.int64)
    end = tl.load(table_ptr + pid_c * 3 + 1).to(tl.int64)
    if end <= start:
        return
    rows = tl.arange(0, C)
    tok = start + rows
    rmask = tok < end
    b_beta = tl.load(beta_ptr + tok * H + pid_h, mask=rmask, other=0.0).to(tl.float32)
    if HAS_G:
        b_g = tl.load(g_ptr + tok * H + pid_h, mask=rmask, other=0.0).to(tl.float32)
        b_gamma = tl.cumsum(b_g, axis=0)
    else:
        b_gamma = tl.zeros([C], dtype=tl.float32)
    tl.store(gamma_ptr + tok * H + pid_h, b_gamma, mask=rmask)

    strict = rows[:, None] > rows[None, :]
    diff = tl.where(strict, b_gamma[:, None] - b_gamma[None, :], float("-inf"))
    # K is walked in blocks of KB so that no [C, K] fp32 tile stays live.
    b_kk = tl.zeros([C, C], dtype=tl.float32)
    for k0 in range(0, K, KB):
        offs_k = k0 + tl.arange(0, KB)
        b_k = tl.load(k_ptr + (tok[:, None] * H + pid_h) * K + offs_k[None, :],
                      mask=rmask[:, None] & (offs_k < K)[None, :], other=0.0)
        b_kk += tl.dot(b_k, tl.trans(b_k), input_precision=PREC)
    b_a = tl.where(strict, b_beta[:, None] * b_kk * tl.exp(diff), 0.0)
    # T = (I + A)^{-1} by blocks of 16: the diagonal blocks by forward substitution, then
    # T_ij = -T_ii sum_{j<=m<i} A_im T_mj. Blocks go through the tinv buffer (this program's own rows) because
    # register tiles cannot be sliced; the barriers make each store visible to the loads that follow.
    t_base = tinv_ptr + (tok[:, None] * H + pid_h) * C + rows[None, :]
    tl.store(t_base, b_a, mask=rmask[:, None])
    tl.debug_barrier()
    r16 = tl.arange(0, 16)
    blk = tinv_ptr + ((start + r16)[:, None] * H + pid_h) * C + r16[None, :]
    lim = end - start
    a10 = _load_block(blk, r16, lim, 1, 0, H, C)
    a20 = _load_block(blk, r16, lim, 2, 0, H, C)
    a21 = _load_block(blk, r16, lim, 2, 1, H, C)
    a30 = _load_block(blk, r16, lim, 3, 0, H, C)
    a31 = _load_block(blk, r16, lim, 3, 1, H, C)
    a32 = _load_block(blk, r16, lim, 3, 2, H, C)
    t00, t11, t22, t33 = _inv_diag_blocks(blk, tinv_ptr + (start * H + pid_h) * C, r16, lim, H, C)
    t10 = -_dot3(t11, a10, t00, PREC)
    t21 = -_dot3(t22, a21, t11, PREC)
    t32 = -_dot3(t33, a32, t22, PREC)
    t20 = -tl.dot(t22, tl.dot(a20, t00, input_precision=PREC) + tl.dot(a21, t10, input_precision=PREC),
                  input_precision=PREC)
    t31 = -tl.dot(t33, tl.dot(a31, t11, input_precision=PREC) + tl.dot(a32, t21, input_precision=PREC),
                  input_precision=PREC)
    t30 = -tl.dot(t33, tl.dot(a30, t00, input_precision=PREC) + tl.dot(a31, t10, input_precision=PREC)
                  + tl.dot(a32, t20, input_precision=PREC), input_precision=PREC)
    tl.debug_barrier()
    _store_block(blk, r16, lim, 0, 0, t00, H, C)
    _store_block(blk, r16, lim, 1, 0, t10, H, C)
    _store_block(blk, r16, lim, 1, 1, t11, H, C)
    _store_block(blk, r16, lim, 2, 0, t20, H, C)
    _store_block(blk, r16, lim, 2, 1, t21, H, C)
    _store_block(blk, r16, lim, 2, 2, t22, H, C)
    _store_block(blk, r16, lim, 3, 0, t30, H, C)
    _store_block(blk, r16, lim, 3, 1, t31, H, C)
    _store_block(blk, r16, lim, 3, 2, t32, H, C)
    _store_block(blk, r16, lim, 3, 3, t33, H, C)
    tl.debug_barrier()
    b_t = tl.load(t_base, mask=rmask[:, None], other=0.0)
    dt = k_ptr.dtype.element_ty
    b_xw = b_beta * tl.exp(b_gamma)
    if MODE == 2:
        # W = (T diag(beta e^gamma)) K and U~ = (T diag(beta)) V with K, V exact in the input dtype and the fp32
        # left factor split into hi + lo input-dtype parts: two 16-bit products, ~2^-16 relative error (tf32: 2^-11).
        b_tw = b_t * b_xw[None, :]
        b_tw_hi = b_tw.to(dt)
        b_tw_lo = (b_tw - b_tw_hi.to(tl.float32)).to(dt)
        b_tu = b_t * b_beta[None, :]
        b_tu_hi = b_tu.to(dt)
        b_tu_lo = (b_tu - b_tu_hi.to(tl.float32)).to(dt)
    elif MODE == 1:
        b_t = b_t.to(dt)

    for k0 in range(0, K, KB):
        offs_k = k0 + tl.arange(0, KB)
        mk = rmask[:, None] & (offs_k < K)[None, :]
        kptrs = (tok[:, None] * H + pid_h) * K + offs_k[None, :]
        if MODE == 2:
            b_k = tl.load(k_ptr + kptrs, mask=mk, other=0.0)
            b_w = tl.dot(b_tw_hi, b_k, input_precision=PREC) + tl.dot(b_tw_lo, b_k, input_precision=PREC)
        else:
            b_x = tl.load(k_ptr + kptrs, mask=mk, other=0.0).to(tl.float32) * b_xw[:, None]
            b_w = tl.dot(b_t, b_x.to(b_t.dtype), input_precision=PREC)
        tl.store(w_ptr + kptrs, b_w.to(w_ptr.dtype.element_ty), mask=mk)
    for v0 in range(0, V, BV):
        offs_v = v0 + tl.arange(0, BV)
        vmask = offs_v < V
        m2 = rmask[:, None] & vmask[None, :]
        b_v = tl.load(v_ptr + (tok[:, None] * H + pid_h) * V + offs_v[None, :], mask=m2, other=0.0)
        if MODE == 2:
            b_u = tl.dot(b_tu_hi, b_v, input_precision=PREC) + tl.dot(b_tu_lo, b_v, input_precision=PREC)
        else:
            b_u = tl.dot(b_t, (b_v.to(tl.float32) * b_beta[:, None]).to(b_t.dtype), input_precision=PREC)
        tl.store(ut_ptr + (tok[:, None] * H + pid_h) * V + offs_v[None, :], b_u.to(ut_ptr.dtype.element_ty),
                 mask=m2)


@triton.jit
def _state_kernel(
    k_ptr, gamma_ptr, w_ptr, ut_ptr, bounds_ptr, choff_ptr, h0_ptr,
    h_ptr, u_ptr, ht_ptr, q_ptr, o_ptr, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, PREC: tl.constexpr, OUT: tl.constexpr, SCALE_V: tl.constexpr,
):
    """Forward pass over a document's chunks. OUT: also write the chunk's output O (the output kernel's math, on the
    same rounded operands: the state and U in the input dtype), off the recurrence's critical path."""
    pid_v = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_n = tl.program_id(2)
    bos = tl.load(bounds_ptr + pid_n).to(tl.int64)
    eos = tl.load(bounds_ptr + pid_n + 1).to(tl.int64)
    c0 = tl.load(choff_ptr + pid_n).to(tl.int64)
    nch = (eos - bos + C - 1) // C
    rows = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    kmask = offs_k < K
    vmask = offs_v < V
    smask = kmask[:, None] & vmask[None, :]
    s_off = offs_k[:, None] * V + offs_v[None, :]

    state = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        state += tl.load(h0_ptr + (pid_n * H + pid_h) * K * V + s_off, mask=smask, other=0.0).to(tl.float32)
    for c in range(nch):
        start = bos + c * C
        tok = start + rows
        rmask = tok < eos
        last = tl.minimum(start + C, eos) - 1
        tl.store(h_ptr + ((c0 + c) * H + pid_h) * K * V + s_off, state.to(h_ptr.dtype.element_ty), mask=smask)
        b_w = tl.load(w_ptr + (tok[:, None] * H + pid_h) * K + offs_k[None, :],
                      mask=rmask[:, None] & kmask[None, :], other=0.0)
        m2 = rmask[:, None] & vmask[None, :]
        b_ut = tl.load(ut_ptr + (tok[:, None] * H + pid_h) * V + offs_v[None, :], mask=m2, other=0.0)
        b_u = b_ut.to(tl.float32) - tl.dot(b_w, state.to(b_w.dtype), input_precision=PREC)
        tl.store(u_ptr + (tok[:, None] * H + pid_h) * V + offs_v[None, :], b_u.to(u_ptr.dtype.element_ty), mask=m2)
        b_gamma = tl.load(gamma_ptr + tok * H + pid_h, mask=rmask, other=0.0)
        g_last = tl.load(gamma_ptr + last * H + pid_h)
        b_k = tl.load(k_ptr + (tok[:, None] * H + pid_h) * K + offs_k[None, :],
                      mask=rmask[:, None] & kmask[None, :], other=0.0)
        if OUT:
            b_q = tl.load(q_ptr + (tok[:, None] * H + pid_h) * K + offs_k[None, :],
                          mask=rmask[:, None] & kmask[None, :], other=0.0)
            incl = rows[:, None] >= rows[None, :]
            decay = tl.exp(tl.where(incl, b_gamma[:, None] - b_gamma[None, :], float("-inf")))
            b_qk = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * decay
            b_o = tl.dot(b_q, state.to(h_ptr.dtype.element_ty).to(b_q.dtype), input_precision=PREC)
            b_o = b_o * tl.exp(b_gamma)[:, None]
            b_ul = b_u.to(u_ptr.dtype.element_ty)
            b_o += tl.dot(b_qk.to(b_ul.dtype), b_ul, input_precision=PREC)
            tl.store(o_ptr + (tok[:, None] * H + pid_h) * V + offs_v[None, :],
                     (b_o * scale).to(o_ptr.dtype.element_ty), mask=m2)
        if SCALE_V:
            # Kbar^T U = K^T (diag(e^{gamma_C - gamma}) U): the decay goes on the [C, BV] tile, K feeds the product
            # as loaded (no [C, K] fp32 temporary).
            b_ud = (b_u * tl.exp(g_last - b_gamma)[:, None]).to(b_w.dtype)
            state = state * tl.exp(g_last) + tl.dot(tl.trans(b_k), b_ud, input_precision=PREC)
        else:
            b_kbar = (b_k.to(tl.float32) * tl.exp(g_last - b_gamma)[:, None]).to(b_w.dtype)
            state = state * tl.exp(g_last) + tl.dot(tl.trans(b_kbar), b_u.to(b_w.dtype), input_precision=PREC)
    if STORE_HT:
        tl.store(ht_ptr + (pid_n * H + pid_h) * K * V + s_off, state, mask=smask)


@triton.jit
def _output_kernel(
    q_ptr, k_ptr, gamma_ptr, h_ptr, u_ptr, table_ptr, o_ptr, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    pid_v = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_h = tl.program_id(2)
    start = tl.load(table_ptr + pid_c * 3).to(tl.int64)
    end = tl.load(table_ptr + pid_c * 3 + 1).to(tl.int64)
    if end <= start:
        return
    rows = tl.arange(0, C)
    tok = start + rows
    rmask = tok < end
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    kmask = offs_k < K
    vmask = offs_v < V
    mk = rmask[:, None] & kmask[None, :]
    b_q = tl.load(q_ptr + (tok[:, None] * H + pid_h) * K + offs_k[None, :], mask=mk, other=0.0)
    b_k = tl.load(k_ptr + (tok[:, None] * H + pid_h) * K + offs_k[None, :], mask=mk, other=0.0)
    b_gamma = tl.load(gamma_ptr + tok * H + pid_h, mask=rmask, other=0.0)
    b_h = tl.load(h_ptr + (pid_c.to(tl.int64) * H + pid_h) * K * V + offs_k[:, None] * V + offs_v[None, :],
                  mask=kmask[:, None] & vmask[None, :], other=0.0)
    m2 = rmask[:, None] & vmask[None, :]
    b_u = tl.load(u_ptr + (tok[:, None] * H + pid_h) * V + offs_v[None, :], mask=m2, other=0.0)
    incl = rows[:, None] >= rows[None, :]
    decay = tl.exp(tl.where(incl, b_gamma[:, None] - b_gamma[None, :], float("-inf")))
    b_qk = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * decay
    b_o = tl.dot(b_q, b_h.to(b_q.dtype), input_precision=PREC) * tl.exp(b_gamma)[:, None]
    b_o += tl.dot(b_qk.to(b_u.dtype), b_u, input_precision=PREC)
    tl.store(o_ptr + (tok[:, None] * H + pid_h) * V + offs_v[None, :], (b_o * scale).to(o_ptr.dtype.element_ty),
             mask=m2)


def launch_warps(kernel: str) -> int:
    """Warps of one launch: OPTIONS[kernel + "_warps"] where set (state, state_bwd, grads), else NUM_WARPS."""
    return int(OPTIONS.get(kernel + "_warps", 0)) or NUM_WARPS[kernel]


def state_block_v(dk: int, dv: int, pairs: int, device: torch.device, which: str) -> int:
    """V-block of a sequential state pass for `pairs` (sequence, head) pairs (no dependence on T).

    V columns of the state are independent, so a pass splits V across programs freely (K cannot be split: U = U~ - W S
    contracts over it). While pairs * cdiv(V, BV) is below the multiprocessor count the block is halved, down to
    state_bv_floor(dk): at T = 32768, B = 1, H = 16, K = V = 128 that is 128 programs of [K, 16] instead of 32 of
    [K, 64]."""
    bv = min(STATE_BV[which], max(16, triton.next_power_of_2(dv)))
    if device.type == "cuda":
        floor = state_bv_floor(dk)
        while bv > floor and pairs * triton.cdiv(dv, bv) < multiprocessors(device):
            bv //= 2
    return bv


def state_bv_floor(dk: int) -> int:
    """Smallest V-block the state passes halve to: OPTIONS["state_bv_min"] where set (16 at the least, the smallest
    tl.dot width), else 16 up to K = 128 and 32 past it (measurements in the OPTIONS notes)."""
    chosen = int(OPTIONS["state_bv_min"])
    return max(16, chosen) if chosen else (16 if dk <= 128 else 32)


def state_stages(bk: int, elem_bytes: int = 2, bv: int = 64) -> int:
    """Software-pipelining depth of the state passes: Triton's default 3 up to K = 128 for 16-bit inputs; at K = 256
    three copies of the per-chunk [C, K] tiles would overflow the 227 KB of shared memory, so 16-bit V-blocks
    bv <= 32 take OPTIONS["wide_stages"] (2) and everything else is not pipelined. fp32 tiles are twice as large: the
    backward state pass at K = 128 needs 263,176 bytes with 3 stages and 147,972 with 2 (Triton 3.6, sm_90,
    benchmarks/triton_resources.py), so fp32 takes 2 there and 1 at K = 256."""
    if bk > 128:
        return int(OPTIONS["wide_stages"]) if bv <= 32 and elem_bytes == 2 else 1
    return 2 if elem_bytes > 2 and bk >= 128 else 3


def block_sizes(dk: int, dv: int):
    bk = max(16, triton.next_power_of_2(dk))
    bv = min(64, max(16, triton.next_power_of_2(dv)))
    return bk, bv


def delta_rule_fwd(q, k, v, beta, g, scale, initial_state, output_final_state, bounds, table, choff):
    """q, k [L, H, K]; v [L, H, V]; beta, g [L, H] (g None: no decay); bounds int64 [N+1]; table/choff from
    kernels.common.varlen.chunk_table. Returns (o [L, H, V], final [N, H, K, V] fp32 or None, and the saved
    intermediates (gamma, tinv, w, ut, u, h) that the backward reuses)."""
    total, h, dk = q.shape
    dv = v.shape[-1]
    n = bounds.numel() - 1
    rows = table.shape[0]
    bk, bv = block_sizes(dk, dv)
    prec = dot_precision(q.dtype)
    dev = q.device
    gamma = torch.empty(total, h, device=dev, dtype=torch.float32)
    tinv = torch.empty(total, h, CHUNK, device=dev, dtype=torch.float32)
    w = torch.empty(total, h, dk, device=dev, dtype=q.dtype)
    ut = torch.empty(total, h, dv, device=dev, dtype=q.dtype)
    _prepare_kernel[(rows, h)](
        k, v, beta, g if g is not None else beta, table, gamma, tinv, w, ut,
        H=h, K=dk, V=dv, C=CHUNK, KB=min(bk, 64), BV=bv, HAS_G=g is not None, PREC=prec,
        MODE=0 if q.dtype == torch.float32 else int(OPTIONS["prepare_mode"]), num_warps=NUM_WARPS["prepare"],
    )
    hs = torch.empty(rows, h, dk, dv, device=dev, dtype=q.dtype)
    u = torch.empty(total, h, dv, device=dev, dtype=q.dtype)
    final = torch.empty(n, h, dk, dv, device=dev, dtype=torch.float32) if output_final_state else None
    sbv = state_block_v(dk, dv, n * h, dev, "state")
    o = torch.empty(total, h, dv, device=dev, dtype=v.dtype)
    mode = int(OPTIONS["output_in_state"])
    out_fused = mode == 1 or (mode == 2 and sbv >= min(STATE_BV["state"], dv))
    _state_kernel[(triton.cdiv(dv, sbv), h, n)](
        k, gamma, w, ut, bounds, choff, initial_state if initial_state is not None else gamma,
        hs, u, final if final is not None else gamma, q, o, scale,
        H=h, K=dk, V=dv, C=CHUNK, BK=bk, BV=sbv, HAS_H0=initial_state is not None,
        STORE_HT=output_final_state, PREC=prec, OUT=out_fused, SCALE_V=bool(OPTIONS["state_scale_v"]),
        num_warps=launch_warps("state"),
        num_stages=state_stages(bk, k.element_size(), sbv),
    )
    if out_fused:
        return o, final, (gamma, tinv, w, ut, u, hs)
    _output_kernel[(triton.cdiv(dv, bv), rows, h)](
        q, k, gamma, hs, u, table, o, scale,
        H=h, K=dk, V=dv, C=CHUNK, BK=bk, BV=bv, PREC=prec, num_warps=NUM_WARPS["output"],
    )
    return o, final, (gamma, tinv, w, ut, u, hs)
