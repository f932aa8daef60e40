"""Triton forward of the gated delta rule (chunk 64, WY/UT representation; the math is in chunk.py's docstring).

Tensors are viewed as one packed token axis: [B, T, H, D] -> [B*T, H, D] with document boundaries `bounds`
(cu_seqlens, or b*T for fixed-length batches), so fixed-length and varlen inputs share one code path. Three
launches:
  1. prepare (one program per (chunk, head)): gamma (in-chunk cumsum of g), T = (I + A)^{-1} in fp32 by
     blocks of 16 (forward substitution on the diagonal blocks), W = T diag(beta e^gamma) K, U~ = T diag(beta) V;
  2. state pass (one program per (document, head, V-block)): walks the document's chunks in order, storing the
     chunk-start state S and the pseudo-values U = U~ - W S, then S <- e^{gamma_C} S + (e^{gamma_C-gamma} K)^T U;
  3. output (one program per (chunk, head, V-block)): O = scale (diag(e^gamma) Q S + (Q K^T * Gamma * M) U).
Chunk-start states are stored in the input dtype (fp32 inputs: fp32), accumulated in fp32.
"""

import torch
import triton
import triton.language as tl

from hilo_kernels.common.gpu import multiprocessors
from hilo_kernels.common.launch import current, delta_rule_state_bv_floor

CHUNK = 64

# Launch settings (warps, stages, tiles, the state passes' V-block rule): hilo_kernels.common.launch's DeltaRule table,
# overridable for a benchmark with hilo_kernels.common.launch_settings (docs/kernel_settings.md). 16-bit inputs form W and
# U~ from the fp32 T split into hi + lo input-dtype parts (two 16-bit products, more accurate than tf32) and run the
# backward's products on input-dtype operands with its large intermediates (dU) in the input dtype.


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (the fp32 tolerances of docs/kernels.md); 16-bit inputs let fp32 tiles use
    tf32."""
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
    """MODE 0 (fp32 inputs): W = T X and U~ = T Y as products of fp32 tiles; 2 (16-bit inputs): T diag(.) split into
    hi + lo input-dtype parts against the exact K, V tiles."""
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

    # padded rows (past the end) masked out: their exp(gamma_i - gamma_j) can overflow (docs/kernels.md)

    strict = (rows[:, None] > rows[None, :]) & rmask[:, None]
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
    h_ptr, u_ptr, ht_ptr,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, PREC: tl.constexpr,
):
    """Forward pass over a document's chunks."""
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
        # Kbar^T U = K^T (diag(e^{gamma_C - gamma}) U): the decay goes on the [C, BV] tile, K feeds the product as
        # loaded (no [C, K] fp32 temporary; fewer registers than decaying K: sm_90 spills 96 B instead of 992 B).
        b_ud = (b_u * tl.exp(g_last - b_gamma)[:, None]).to(b_w.dtype)
        state = state * tl.exp(g_last) + tl.dot(tl.trans(b_k), b_ud, input_precision=PREC)
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
    # padded rows (past the end) masked out: their exp(gamma_i - gamma_j) can overflow (docs/kernels.md)
    incl = (rows[:, None] >= rows[None, :]) & rmask[:, None]
    decay = tl.exp(tl.where(incl, b_gamma[:, None] - b_gamma[None, :], float("-inf")))
    b_qk = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * decay
    b_o = tl.dot(b_q, b_h.to(b_q.dtype), input_precision=PREC) * tl.exp(b_gamma)[:, None]
    b_o += tl.dot(b_qk.to(b_u.dtype), b_u, input_precision=PREC)
    tl.store(o_ptr + (tok[:, None] * H + pid_h) * V + offs_v[None, :], (b_o * scale).to(o_ptr.dtype.element_ty),
             mask=m2)


def state_block_v(dk: int, dv: int, pairs: int, device: torch.device, which: str) -> int:
    """V-block of a sequential state pass for `pairs` (sequence, head) pairs (no dependence on T).

    V columns of the state are independent, so a pass splits V across programs freely (K cannot be split: U = U~ - W S
    contracts over it). While pairs * cdiv(V, BV) is below the multiprocessor count the block is halved, down to
    delta_rule_state_bv_floor(dk): at T = 32768, B = 1, H = 16, K = V = 128 that is 128 programs of [K, 16] instead of 32 of
    [K, 64]."""
    widest = current("delta_rule").state_bv if which == "state" else current("delta_rule").state_bwd_bv
    bv = min(widest, max(16, triton.next_power_of_2(dv)))
    if device.type == "cuda":
        floor = delta_rule_state_bv_floor(dk)
        while bv > floor and pairs * triton.cdiv(dv, bv) < multiprocessors(device):
            bv //= 2
    return bv


def state_stages(bk: int, elem_bytes: int = 2, bv: int = 64) -> int:
    """Software-pipelining depth of the state passes: Triton's default 3 up to K = 128 for 16-bit inputs; at K = 256
    three copies of the per-chunk [C, K] tiles would overflow the 227 KB of shared memory, so 16-bit V-blocks
    bv <= 32 take the wide_stages setting (2) and everything else is not pipelined. fp32 tiles are twice as large: the
    backward state pass at K = 128 needs 263,176 bytes with 3 stages and 147,972 with 2 (Triton 3.6, sm_90,
    compiled ahead of time), so fp32 takes 2 there and 1 at K = 256."""
    if bk > 128:
        return current("delta_rule").wide_stages if bv <= 32 and elem_bytes == 2 else 1
    return 2 if elem_bytes > 2 and bk >= 128 else 3


def block_sizes(dk: int, dv: int):
    bk = max(16, triton.next_power_of_2(dk))
    bv = min(64, max(16, triton.next_power_of_2(dv)))
    return bk, bv


def delta_rule_fwd(q, k, v, beta, g, scale, initial_state, output_final_state, bounds, table, choff):
    """q, k [L, H, K]; v [L, H, V]; beta, g [L, H] (g None: no decay); bounds int64 [N+1]; table/choff from
    hilo_kernels.common.varlen.chunk_table. Returns (o [L, H, V], final [N, H, K, V] fp32 or None, and the saved
    intermediates (gamma, tinv, w, u, h) that the backward reuses; ut, read by the forward alone, is not kept)."""
    total, h, dk = q.shape
    dv = v.shape[-1]
    n = bounds.numel() - 1
    rows = table.shape[0]
    bk, bv = block_sizes(dk, dv)
    prec = dot_precision(q.dtype)
    dev = q.device
    launch = current("delta_rule")
    gamma = torch.empty(total, h, device=dev, dtype=torch.float32)
    tinv = torch.empty(total, h, CHUNK, device=dev, dtype=torch.float32)
    w = torch.empty(total, h, dk, device=dev, dtype=q.dtype)
    ut = torch.empty(total, h, dv, device=dev, dtype=q.dtype)
    _prepare_kernel[(rows, h)](
        k, v, beta, g if g is not None else beta, table, gamma, tinv, w, ut,
        H=h, K=dk, V=dv, C=CHUNK, KB=min(bk, 64), BV=bv, HAS_G=g is not None, PREC=prec,
        MODE=0 if q.dtype == torch.float32 else 2, num_warps=launch.prepare_warps,
    )
    hs = torch.empty(rows, h, dk, dv, device=dev, dtype=q.dtype)
    u = torch.empty(total, h, dv, device=dev, dtype=q.dtype)
    final = torch.empty(n, h, dk, dv, device=dev, dtype=torch.float32) if output_final_state else None
    sbv = state_block_v(dk, dv, n * h, dev, "state")
    o = torch.empty(total, h, dv, device=dev, dtype=v.dtype)
    _state_kernel[(triton.cdiv(dv, sbv), h, n)](
        k, gamma, w, ut, bounds, choff, initial_state if initial_state is not None else gamma,
        hs, u, final if final is not None else gamma,
        H=h, K=dk, V=dv, C=CHUNK, BK=bk, BV=sbv, HAS_H0=initial_state is not None,
        STORE_HT=output_final_state, PREC=prec, num_warps=launch.state_warps,
        num_stages=state_stages(bk, k.element_size(), sbv),
    )
    _output_kernel[(triton.cdiv(dv, bv), rows, h)](
        q, k, gamma, hs, u, table, o, scale,
        H=h, K=dk, V=dv, C=CHUNK, BK=bk, BV=bv, PREC=prec, num_warps=launch.output_warps,
    )
    return o, final, (gamma, tinv, w, u, hs)
