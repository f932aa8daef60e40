"""Triton backward of chunked linear attention, and what ties forward and backward: a torch.library custom op pair
for fixed-length calls, an autograd.Function for packed documents.

With gc/gl as in triton_fwd, S_in the state entering a chunk (saved by the forward, in the inputs' dtype) and
dS_out the gradient of the state leaving it:
  dS_in    = exp(gl) dS_out + scale * (q * exp(gc))^T do            (reverse pass over each document's chunks;
                                                                      dS_out of the last chunk = d final state,
                                                                      dS_in of the first = d initial_state)
  dA_ij    = scale * exp(gc_i - gc_j) [j <= i] (do_i . v_j)
  dq       = scale * exp(gc) * (do S_in^T) + dA k
  dk       = exp(gl - gc) * (v dS_out^T) + dA^T q
  dv       = exp(gl - gc) * (k dS_out) + (scale * exp(gc_i - gc_j) [j <= i] (q_i . k_j))^T do
Gate gradient: every decay enters as exp(G_t - G_s) with G the in-document cumsum of g, so
dL/dG_t = q_t . dq_t - k_t . dk_t (+ <S_T, dS_T> at a document's last token, from the final state), and
dg_t = sum_{s >= t in its document} dL/dG_s. (Derived by hand; checked against autograd of the chunk path.)
That sum is not taken over the whole document: its terms are large and cancel (a pair of tokens i > j enters
at i through q_i . dq_i and leaves at j through k_j . dk_j, each rounded on its own path), and in bf16 the
leftover grew with the number of chunks summed (linear_attn's dg ratio 1.76e-2 of the 2e-2 bound at T = 777; the
HLA compositions' passes compound it past the bound). Instead, at a chunk's first token,
  dg = <dS_in, S_in> = exp(gl) <dS_out, S_in> + sum_t q_t . dq_t(through S_in)
exactly (g there scales the whole entering state, read by every later token; dS_in as above, the gradient S_in
gets from this chunk on), from tiles each chunk's backward program loads anyway (the two-kernel path takes
<dS_out, S_in> in _chunk_dv_bwd, run first), and a token's dg is that value minus the sum of dL/dG over the chunk's
earlier tokens (at most 63 terms). On the H200 (bf16, T = 777) dg's error ratio went 1.76e-2 -> 4.7e-3 with the
same value taken in the sequential dstates pass, which cost that pass 128 -> 228 registers a thread
(sm_90, AOT) and linear_attn 2.07 -> 2.18 ms at 16K; this form leaves the pass as it was (128): on the H200 its
check passes with dg under o's 3.7e-3 and linear_attn takes 1.99 ms at 16K. A float64 emulation of the
kernels' bf16 roundings reproduces both earlier forms (1.52e-2, 4.94e-3) and
gives this one 3.85e-3.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from hilo_kernels.common.compile import absent_grad, dense_outputs, grad_or_zeros, unused_grads_stay_none
from hilo_kernels.common.launch import current

from .triton_fwd import (
    BT,
    Layout,
    _chunk_bounds,
    _pow2,
    _seq_bounds,
    _through_segment,
    chunk_fwd,
    dot_precision,
    segment_launch,
    state_blocks,
)

FUSED_MAX_DIM = 128  # larger head dims take the two-kernel backward (K- and V-blocked)


@triton.jit(do_not_specialize=["T", "NT", "SEG"])
def _chunk_dstates_bwd(q, do, g, dht, dhs, dh0, fin, gseg, bounds, offsets, scale, T, NT, SEG,
                       H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, HAS_G: tl.constexpr, HAS_DHT: tl.constexpr,
                       STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr, FINALS: tl.constexpr):
    """dS_out of each chunk of a segment, walking it backwards (segments as in _chunk_states_fwd, mirrored: FINALS
    launches segments from 1 on and stores each one's own contribution to the gradient where it begins, walked
    from its start as a plain sum of products, and its gates' sum; the others start from dht carried back through
    the later segments' fin)."""
    i_kv, i_nh, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if FINALS:
        i_s += 1  # segment 0's own share carries nowhere
    NV: tl.constexpr = triton.cdiv(V, BV)
    i_k, i_v = i_kv // NV, i_kv % NV
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, c0 = _seq_bounds(bounds, offsets, i_n, T, NT, IS_VARLEN)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    kv_off = o_k[:, None] * V + o_v[None, :]
    n_kv = tl.num_programs(1).to(tl.int64) * K * V
    nchunks = tl.cdiv(eos - bos, BT)
    nseg = tl.maximum(nchunks - 1, 0) // SEG + 1  # this document's (a shorter one leaves programs idle)
    if i_s >= nseg:
        return
    dstate = tl.zeros([BK, BV], dtype=tl.float32)
    if not FINALS:
        if HAS_DHT:
            dstate += tl.load(dht + i_nh.to(tl.int64) * K * V + kv_off, mask=m_kv, other=0.0).to(tl.float32)
        for jj in range(nseg - 1 - i_s):  # the gradient leaving this segment, from the later segments' own shares
            dstate = _through_segment(dstate, fin, gseg, nseg - 1 - jj, i_nh, kv_off, m_kv, K, V, HAS_G)
    c_lo = i_s * SEG
    c_hi = tl.minimum(c_lo + SEG, nchunks)
    before = 0.0  # FINALS: the gates of the segment's earlier chunks
    for it in range(c_hi - c_lo):
        if FINALS:  # from the segment's start: each token's decay to it is known, so a plain sum of products
            c = c_lo + it
        else:
            c = c_hi - 1 - it
            tl.store(dhs + ((c0 + c) * H + i_h) * K * V + kv_off, dstate.to(dhs.dtype.element_ty), mask=m_kv)
        o_t = bos + c * BT + tl.arange(0, BT)
        m_t = o_t < eos
        qb = tl.load(q + (o_t[:, None] * G + i_h // (H // G)) * K + o_k[None, :],
                     mask=m_t[:, None] & (o_k[None, :] < K), other=0.0)
        dob = tl.load(do + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_t[:, None] & (o_v[None, :] < V),
                      other=0.0)
        if HAS_G:
            gb = tl.load(g + o_t * H + i_h, mask=m_t, other=0.0).to(tl.float32)
            gc = tl.cumsum(gb, 0)
            if FINALS:
                qb = (qb * (tl.exp(before + gc) * scale)[:, None]).to(dob.dtype)
                before += tl.sum(gb, 0)
            else:
                dstate *= tl.exp(tl.sum(gb, 0))
                qb = (qb * (tl.exp(gc) * scale)[:, None]).to(dob.dtype)
        else:
            qb = (qb * scale).to(dob.dtype)
        dstate += tl.dot(tl.trans(qb), dob, input_precision=PREC)
    if FINALS:
        tl.store(fin + i_s * n_kv + i_nh.to(tl.int64) * K * V + kv_off, dstate, mask=m_kv)
        if HAS_G:  # noqa: SIM102 (a constexpr around a runtime test)
            if i_kv == 0:  # the segment's gates' sum, for the second launch's carry
                tl.store(gseg + i_s * tl.num_programs(1) + i_nh, before)
    elif STORE_DH0:  # noqa: SIM102 (a constexpr around a runtime test)
        if i_s == 0:
            tl.store(dh0 + i_nh.to(tl.int64) * K * V + kv_off, dstate, mask=m_kv)


@triton.jit(do_not_specialize=["T", "NT"])
def _chunk_dqk_bwd(q, k, v, g, do, hs, dhs, state_dots, dq, dk, dgp, table, scale, T, NT, TT, ROWS,
                   H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
                   NV: tl.constexpr):
    i_k, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = _chunk_bounds(table, i_c, T, NT, BT, IS_VARLEN)
    if start >= end:
        return
    o_t = start + tl.arange(0, BT)
    m_t = o_t < end
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    state_base = (i_c.to(tl.int64) * H + i_h) * K * V
    d_scores = tl.zeros([BT, BT], dtype=tl.float32)
    acc_q = tl.zeros([BT, BK], dtype=tl.float32)
    acc_k = tl.zeros([BT, BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v[None, :] < V)
        dob = tl.load(do + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0)
        vb = tl.load(v + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0)
        # states as [BV, BK] tiles (transposed loads)
        m_vk = (o_v[:, None] < V) & m_k[None, :]
        hb = tl.load(hs + state_base + o_k[None, :] * V + o_v[:, None], mask=m_vk, other=0.0).to(dob.dtype)
        dhb = tl.load(dhs + state_base + o_k[None, :] * V + o_v[:, None], mask=m_vk, other=0.0).to(dob.dtype)
        d_scores += tl.dot(dob, tl.trans(vb), input_precision=PREC)
        acc_q += tl.dot(dob, hb, input_precision=PREC)
        acc_k += tl.dot(vb, dhb, input_precision=PREC)
    m_tk = m_t[:, None] & m_k[None, :]
    qb = tl.load(q + (o_t[:, None] * G + i_h // (H // G)) * K + o_k[None, :], mask=m_tk, other=0.0)
    kb = tl.load(k + (o_t[:, None] * G + i_h // (H // G)) * K + o_k[None, :], mask=m_tk, other=0.0)
    o_i = tl.arange(0, BT)
    causal = o_i[:, None] >= o_i[None, :]
    if HAS_G:
        gb = tl.load(g + o_t * H + i_h, mask=m_t, other=0.0).to(tl.float32)
        gc = tl.cumsum(gb, 0)
        gl = tl.sum(gb, 0)
        acc_q *= (tl.exp(gc) * scale)[:, None]
        acc_k *= tl.exp(gl - gc)[:, None]
        d_scores *= tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf"))) * scale
        # dg at the first token; <dS_out, S_in> comes from _chunk_dv_bwd (NV V-blocks' shares), added by K-block 0
        entering = tl.sum(tl.sum(qb.to(tl.float32) * acc_q, 1), 0)
        if i_k == 0:
            for j in range(NV):
                entering += tl.exp(gl) * tl.load(state_dots + (j * ROWS + i_c.to(tl.int64)) * H + i_h)
    else:
        acc_q *= scale
        d_scores *= scale
    d_scores = tl.where(causal, d_scores, 0.0).to(qb.dtype)
    acc_q += tl.dot(d_scores, kb, input_precision=PREC)
    acc_k += tl.dot(tl.trans(d_scores), qb, input_precision=PREC)
    tok = (o_t[:, None] * H + i_h) * K + o_k[None, :]
    tl.store(dq + tok, acc_q.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + tok, acc_k.to(dk.dtype.element_ty), mask=m_tk)
    if HAS_G:  # this K-block's share of dg (the host sums the blocks)
        dgate = tl.sum(qb.to(tl.float32) * acc_q - kb.to(tl.float32) * acc_k, 1)
        dgate = entering - (tl.cumsum(dgate, 0) - dgate)
        tl.store(dgp + i_k.to(tl.int64) * TT * H + o_t * H + i_h, dgate, mask=m_t)


@triton.jit(do_not_specialize=["T", "NT"])
def _chunk_dv_bwd(q, k, g, do, hs, dhs, dv, state_dots, table, scale, T, NT, ROWS,
                  H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    """dv of one (V-block, chunk, head), and with g this V-block's share of <dS_out, S_in> for _chunk_dqk_bwd's dg
    (there, inside its V loop, the product spilled registers at K = 256; 2026-11-30, AOT for sm_90)."""
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = _chunk_bounds(table, i_c, T, NT, BT, IS_VARLEN)
    if start >= end:
        return
    o_t = start + tl.arange(0, BT)
    m_t = o_t < end
    o_v = i_v * BV + tl.arange(0, BV)
    m_tv = m_t[:, None] & (o_v[None, :] < V)
    state_base = (i_c.to(tl.int64) * H + i_h) * K * V
    scores_t = tl.zeros([BT, BT], dtype=tl.float32)  # [j, i] = k_j . q_i
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    state_dot = 0.0
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k[None, :] < K)
        qb = tl.load(q + (o_t[:, None] * G + i_h // (H // G)) * K + o_k[None, :], mask=m_tk, other=0.0)
        kb = tl.load(k + (o_t[:, None] * G + i_h // (H // G)) * K + o_k[None, :], mask=m_tk, other=0.0)
        m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
        dhb = tl.load(dhs + state_base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
        if HAS_G:
            hb = tl.load(hs + state_base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
            state_dot += tl.sum(tl.sum(hb.to(tl.float32) * dhb.to(tl.float32), 1), 0)
        dhb = dhb.to(kb.dtype)
        scores_t += tl.dot(kb, tl.trans(qb), input_precision=PREC)
        acc += tl.dot(kb, dhb, input_precision=PREC)
    o_i = tl.arange(0, BT)
    anti = o_i[:, None] <= o_i[None, :]  # j <= i in [j, i] layout
    if HAS_G:
        gb = tl.load(g + o_t * H + i_h, mask=m_t, other=0.0).to(tl.float32)
        gc = tl.cumsum(gb, 0)
        gl = tl.sum(gb, 0)
        acc *= tl.exp(gl - gc)[:, None]
        scores_t *= tl.exp(tl.where(anti, gc[None, :] - gc[:, None], float("-inf"))) * scale
    else:
        scores_t *= scale
    dob = tl.load(do + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0)
    scores_t = tl.where(anti, scores_t, 0.0).to(dob.dtype)
    acc += tl.dot(scores_t, dob, input_precision=PREC)
    tl.store(dv + (o_t[:, None] * H + i_h) * V + o_v[None, :], acc.to(dv.dtype.element_ty), mask=m_tv)
    if HAS_G:
        tl.store(state_dots + (i_v * ROWS + i_c.to(tl.int64)) * H + i_h, state_dot)


@triton.jit
def _chunk_gates(g, o_t, m_t, i_h, causal, scale, H: tl.constexpr):
    """A chunk's gates for the backward kernels: in-chunk cumsum gc, total gl, each key's decay to the chunk's end
    exp(gl - gc), and the scaled causal decay matrix scale * exp(gc_i - gc_j) [j <= i]."""
    gb = tl.load(g + o_t * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    gc = tl.cumsum(gb, 0)
    gl = tl.sum(gb, 0)
    return gc, gl, tl.exp(gl - gc), tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf"))) * scale


@triton.jit(do_not_specialize=["T", "NT"])
def _chunk_bwd_fused(q, k, v, g, do, hs, dhs, dq, dk, dv, dg, dq_acc, table, scale, T, NT,
                     H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
                     ACC_DQ: tl.constexpr = False, SELF_V: tl.constexpr = False):
    """dq, dk, dv and dg of one (chunk, head) when K <= BK and V <= BV (one tile each): q, k, v, do and both
    states are read once. Ordered so that one gradient accumulator is live at a time. dg as the module docstring
    says: <dS_in, S_in> at the chunk's first token, less the in-chunk cumsum of q . dq - k . dk before each.
    For a caller that would add gradients afterwards (HLA's passes): ACC_DQ adds dq_acc (per head) into dq, and
    SELF_V (the values are the keys, G = H, K = V) stores dk + dv in dk (dv points at dk; dv's share is stored
    first and read back after a barrier, so no second accumulator is live)."""
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
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    tok_k = (o_t[:, None] * H + i_h) * K + o_k[None, :]
    tok_v = (o_t[:, None] * H + i_h) * V + o_v[None, :]
    state_off = (i_c.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    o_i = tl.arange(0, BT)
    causal = o_i[:, None] >= o_i[None, :]
    tok_qk = (o_t[:, None] * G + i_h // (H // G)) * K + o_k[None, :]  # q, k per group; dq, dk per head (tok_k)
    qb = tl.load(q + tok_qk, mask=m_tk, other=0.0)
    kb = tl.load(k + tok_qk, mask=m_tk, other=0.0)
    dob = tl.load(do + tok_v, mask=m_tv, other=0.0)
    if HAS_G:
        gc, gl, k_out, decay = _chunk_gates(g, o_t, m_t, i_h, causal, scale, H)
    else:
        decay = tl.where(causal, scale, 0.0)
    # dv = exp(gl - gc) * (k dS_out) + P^T do, with P_ij = scale * decay_ij * (q_i . k_j)
    dhb = tl.load(dhs + state_off, mask=m_kv, other=0.0).to(kb.dtype)
    p_t = tl.trans(tl.dot(qb, tl.trans(kb), input_precision=PREC) * decay).to(dob.dtype)
    acc = tl.dot(kb, dhb, input_precision=PREC)
    if HAS_G:
        acc *= k_out[:, None]
    acc += tl.dot(p_t, dob, input_precision=PREC)
    tl.store(dv + tok_v, acc.to(dv.dtype.element_ty), mask=m_tv)
    # dA_ij = scale * decay_ij * (do_i . v_j);  dq = scale * exp(gc) * (do S_in^T) + dA k
    vb = tl.load(v + tok_v, mask=m_tv, other=0.0)
    hb = tl.load(hs + state_off, mask=m_kv, other=0.0).to(dob.dtype)
    if HAS_G:  # dg at the chunk's first token: exp(gl) <dS_out, S_in> + sum_t q_t . dq_t(through S_in)
        entering = tl.exp(gl) * tl.sum(tl.sum(hb.to(tl.float32) * dhb.to(tl.float32), 1), 0)
    d_scores = (tl.dot(dob, tl.trans(vb), input_precision=PREC) * decay).to(kb.dtype)
    acc_q = tl.dot(dob, tl.trans(hb), input_precision=PREC)
    if HAS_G:
        acc_q *= (tl.exp(gc) * scale)[:, None]
        entering += tl.sum(tl.sum(qb.to(tl.float32) * acc_q, 1), 0)
    else:
        acc_q *= scale
    acc_q += tl.dot(d_scores, kb, input_precision=PREC)
    if ACC_DQ:
        tl.store(dq + tok_k, (acc_q + tl.load(dq_acc + tok_k, mask=m_tk, other=0.0).to(tl.float32)).to(
            dq.dtype.element_ty), mask=m_tk)
    else:
        tl.store(dq + tok_k, acc_q.to(dq.dtype.element_ty), mask=m_tk)
    if HAS_G:  # this pass's own dq: the decay gradient is its own
        dgate = tl.sum(qb.to(tl.float32) * acc_q, 1)
    # dk = exp(gl - gc) * (v dS_out^T) + dA^T q
    acc_k = tl.dot(vb, tl.trans(dhb), input_precision=PREC)
    if HAS_G:
        acc_k *= k_out[:, None]
    acc_k += tl.dot(tl.trans(d_scores), qb, input_precision=PREC)
    if HAS_G:
        dgate -= tl.sum(kb.to(tl.float32) * acc_k, 1)  # 0 past the chunk's end (the keys' share only)
    if SELF_V:
        tl.debug_barrier()  # dv's share, stored at the same addresses by other threads of this program
        acc_k += tl.load(dk + tok_k, mask=m_tk, other=0.0).to(tl.float32)
    tl.store(dk + tok_k, acc_k.to(dk.dtype.element_ty), mask=m_tk)
    if HAS_G:
        tl.store(dg + o_t * H + i_h, entering - (tl.cumsum(dgate, 0) - dgate), mask=m_t)


def _segment_reverse_cumsum(x: torch.Tensor, lay: Layout) -> torch.Tensor:
    """dg_t = sum_{s >= t, same document} x_s for x [TT, H], on device (no sync).

    With C the inclusive prefix sum along tokens, dg_t = C[eos(t) - 1] - C[t] + x[t]. The scan runs in float64
    along the innermost axis of an [H, TT] copy (torch scans the outer axis of [TT, H] very slowly)."""
    xt = x.t().to(torch.float64).contiguous()
    csum = torch.cumsum(xt, 1)
    tokens = torch.arange(lay.total, device=x.device)
    if lay.varlen:
        seq = (torch.searchsorted(lay.bounds, tokens, right=True) - 1).clamp_(max=lay.n - 1)  # bounds[0] = 0
        last = lay.bounds[seq + 1] - 1
    else:
        last = (tokens // lay.seqlen + 1) * lay.seqlen - 1
    return (csum[:, last] - csum + xt).t().to(torch.float32)


def bwd_launch() -> dict:
    """num_warps, num_stages and (when capped) maxnreg of the fused backward kernel (hilo_kernels.common.launch)."""
    launch = current("linear_attn")
    out = {"num_warps": launch.bwd_warps, "num_stages": launch.bwd_stages}
    if launch.bwd_maxnreg:
        out["maxnreg"] = launch.bwd_maxnreg
    return out


def chunk_bwd(q, k, v, g, do, dht, hs, scale, h0, lay: Layout, need_dh0: bool, dq_acc=None,
              self_values: bool = False):
    """Gradients (dq, dk, dv, dg or None, dh0 or None) on the packed layout; hs are the forward's chunk states. q, k
    [TT, G, K] (G dividing H) as in chunk_fwd; dq, dk come per head, [TT, H, K] (their sum over a group's heads is
    the group's gradient). dq_acc [TT, H, K] is added into dq, and self_values (v is k) returns dk + dv as dk and
    None as dv, both inside the one-tile kernel (fused_accumulation says when it applies)."""
    dk_, dv_ = q.shape[-1], v.shape[-1]
    h = lay.heads
    groups = q.shape[1]
    accumulate = dq_acc is not None or self_values
    if accumulate and not fused_accumulation(q, v, self_values):
        raise ValueError("linear_attn chunk_bwd: dq_acc / self_values need the one-tile backward (K, V <= 128, "
                         "16-bit or K, V <= 64, G = H; K = V for self_values)")
    dhs = torch.empty_like(hs)
    dh0 = torch.empty(lay.n, h, dk_, dv_, device=q.device, dtype=torch.float32) if need_dh0 else None
    bk, bv = state_blocks(dk_, dv_, lay.n * h)
    seg, nseg, fin, gseg, tiles = segment_launch(g, lay, dk_, dv_, bk, bv, q.device)

    def launch(nprog: int, finals: bool):
        _chunk_dstates_bwd[(tiles, lay.n * h, nprog)](
            q, do, g if g is not None else q, dht if dht is not None else q, dhs, dh0 if dh0 is not None else dhs,
            fin if fin is not None else dhs, gseg if gseg is not None else dhs, lay.bounds, lay.offsets, scale,
            lay.seqlen, lay.nt, seg, H=h, G=groups, K=dk_, V=dv_, BT=BT, BK=bk, BV=bv, HAS_G=g is not None,
            HAS_DHT=dht is not None, STORE_DH0=need_dh0, IS_VARLEN=lay.varlen, PREC=dot_precision(k), FINALS=finals,
            num_warps=current("linear_attn").state_warps, num_stages=current("linear_attn").state_stages)

    if nseg > 1:  # segment 0's own share carries nowhere
        launch(nseg - 1, True)
    launch(nseg, False)
    dq = q.new_empty(lay.total, h, dk_)
    dk = k.new_empty(lay.total, h, dk_)
    dv = dk if self_values else torch.empty_like(v)
    gate = g if g is not None else q
    prec = dot_precision(k)
    dg = None
    # fp32 tiles are twice as large: the fused kernel at K = V = 128 needs 272 KiB of shared memory (the H200 has
    # 227 KiB; measured 2026-11-29), so wide fp32 heads take the two-kernel path with K in 64-wide blocks.
    wide_fp32 = q.element_size() > 2 and max(dk_, dv_) > 64
    if dk_ <= FUSED_MAX_DIM and dv_ <= FUSED_MAX_DIM and not wide_fp32:
        dg = torch.empty(lay.total, h, device=q.device, dtype=torch.float32) if g is not None else None
        extra = {"ACC_DQ": dq_acc is not None, "SELF_V": self_values} if accumulate else {}
        _chunk_bwd_fused[(lay.rows, h)](q, k, v, gate, do, hs, dhs, dq, dk, dv, dg if dg is not None else q,
                                        dq_acc if dq_acc is not None else q, lay.table, scale, lay.seqlen, lay.nt,
                                        H=h, G=groups, K=dk_, V=dv_, BT=BT, BK=_pow2(dk_), BV=_pow2(dv_),
                                        HAS_G=g is not None, IS_VARLEN=lay.varlen, PREC=prec, **extra,
                                        **bwd_launch())
    else:
        bk = _pow2(dk_, hi=64 if wide_fp32 else 128)
        stages = 1 if wide_fp32 else 2
        nk = triton.cdiv(dk_, bk)
        bv = _pow2(dv_, hi=64)
        nv = triton.cdiv(dv_, bv)
        # dv first: with g it also takes each V-block's share of <dS_out, S_in> per chunk and head for dg
        state_dots = torch.empty(nv, lay.rows, h, device=q.device, dtype=torch.float32) if g is not None else None
        _chunk_dv_bwd[(nv, lay.rows, h)](q, k, gate, do, hs, dhs, dv, state_dots if state_dots is not None else q,
                                         lay.table, scale, lay.seqlen, lay.nt, lay.rows, H=h, G=groups, K=dk_, V=dv_,
                                         BT=BT, BK=bk, BV=bv, HAS_G=g is not None, IS_VARLEN=lay.varlen, PREC=prec,
                                         num_warps=4, num_stages=stages)
        dgp = torch.empty(nk, lay.total, h, device=q.device, dtype=torch.float32) if g is not None else None
        _chunk_dqk_bwd[(nk, lay.rows, h)](q, k, v, gate, do, hs, dhs, state_dots if state_dots is not None else q,
                                          dq, dk, dgp if dgp is not None else q, lay.table, scale, lay.seqlen,
                                          lay.nt, lay.total, lay.rows, H=h, G=groups, K=dk_, V=dv_, BT=BT, BK=bk,
                                          BV=_pow2(dv_, hi=64), HAS_G=g is not None, IS_VARLEN=lay.varlen, PREC=prec,
                                          NV=nv, num_warps=8, num_stages=stages)
        if g is not None:
            dg = dgp.sum(0)
    return dq, dk, None if self_values else dv, dg, dh0


def fused_accumulation(q: torch.Tensor, v: torch.Tensor, self_values: bool = True) -> bool:
    """Whether chunk_bwd's dq_acc (and with self_values, its self_values) applies to these packed inputs (q
    [TT, G, K], v [TT, H, V]): the one-tile backward kernel (K, V <= 128; <= 64 in fp32), one q / k per head, and
    K = V for self_values."""
    dk_, dv_ = q.shape[-1], v.shape[-1]
    wide_fp32 = q.element_size() > 2 and max(dk_, dv_) > 64
    return (q.shape[1] == v.shape[1] and max(dk_, dv_) <= FUSED_MAX_DIM and not wide_fp32
            and (dk_ == dv_ or not self_values))


def _group_grad(x: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """[TT, H, K] per-head gradients of q or k -> [TT, G, K] in dtype: a group's gradient is the sum of its heads',
    accumulated in fp32 by one reduction (no fp32 copy of the per-head tensor)."""
    tt, h, dk = x.shape
    if groups == h:
        return x.to(dtype)
    return x.reshape(tt, groups, h // groups, dk).sum(2, dtype=torch.float32).to(dtype)


def _flat_inputs(q, k, v, g, h0, cu_seqlens=None):
    """q, k [B, T, G, K], v [B, T, H, V], g, h0 on the packed token axis (contiguous; g and h0 in fp32), and the
    Layout."""
    b, t, groups, dk = q.shape
    h, dv = v.shape[2], v.shape[3]
    qg, kg = (x.reshape(b * t, groups, dk).contiguous() for x in (q, k))
    vf = v.reshape(b * t, h, dv).contiguous()
    gf = None if g is None else g.reshape(b * t, h).contiguous().float()
    h0f = None if h0 is None else h0.contiguous().float()
    return qg, kg, vf, gf, h0f, Layout(b, t, h, cu_seqlens, q.device)


class LinearAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, h0, cu_seqlens, scale, output_final_state):
        b, t, _, dk = q.shape
        h, dv = v.shape[2], v.shape[-1]
        qg, kg, vf, gf, h0f, lay = _flat_inputs(q, k, v, g, h0, cu_seqlens)
        o, ht, hs = chunk_fwd(qg, kg, vf, gf, scale, h0f, lay, output_final_state)
        # The chunk states (K*V/64 values per token and head, in the inputs' dtype) are kept for the backward:
        # recomputing them is a sequential pass that costs as much as the rest of the backward at long T.
        # Grouped q and k stay per group: the kernels read head h's from group h // (H / G).
        ctx.save_for_backward(qg, kg, vf, gf, h0f, hs)
        ctx.lay, ctx.scale, ctx.shape = lay, scale, (b, t, h, dk, dv)
        ctx.h0_dtype = None if h0 is None else h0.dtype
        return o.reshape(b, t, h, dv), ht

    @staticmethod
    def backward(ctx, do, dht):
        qg, kg, vf, gf, h0f, hs = ctx.saved_tensors
        b, t, h, dk, dv = ctx.shape
        groups = qg.shape[1]
        do = do.reshape(b * t, h, dv).contiguous().to(vf.dtype)
        dht = None if dht is None else dht.contiguous().float()
        dq, dk_, dv_, dg, dh0 = chunk_bwd(qg, kg, vf, gf, do, dht, hs, ctx.scale, h0f, ctx.lay,
                                          need_dh0=h0f is not None)
        dq, dk_ = (_group_grad(x, groups, qg.dtype).reshape(b, t, groups, dk) for x in (dq, dk_))
        dv_ = dv_.reshape(b, t, h, dv)
        dg = None if dg is None else dg.reshape(b, t, h)
        dh0 = None if dh0 is None else dh0.to(ctx.h0_dtype)
        return dq, dk_, dv_, dg, dh0, None, None, None


# Fixed-length calls (no cu_seqlens) also exist as a torch.library custom op pair: a compiled graph holds the operator
# as one node (no graph break around it), and its fake gives the outputs' shapes without running anything. Packed
# documents keep the autograd.Function (their chunk count depends on cu_seqlens' values, which a fake cannot know).


@torch.library.custom_op("hilo::linear_attn", mutates_args=())
@dense_outputs
def _linear_attn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],  # noqa: UP045
                    h0: Optional[torch.Tensor], scale: float,  # noqa: UP045 (custom_op reads the annotations)
                    output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32 (empty unless output_final_state), chunk states
    hs [B * ceil(T / 64), H, K, V] in k's dtype, kept for the backward)."""
    qg, kg, vf, gf, h0f, lay = _flat_inputs(q, k, v, g, h0)
    o, ht, hs = chunk_fwd(qg, kg, vf, gf, scale, h0f, lay, output_final_state)
    if ht is None:
        ht = q.new_empty(0, dtype=torch.float32)
    return o.reshape(v.shape), ht, hs


@_linear_attn_op.register_fake
def _(q, k, v, g, h0, scale, output_final_state):
    b, t, _, dk = q.shape
    h, dv = v.shape[2], v.shape[3]
    ht = q.new_empty(b, h, dk, dv, dtype=torch.float32) if output_final_state else q.new_empty(0, dtype=torch.float32)
    return v.new_empty(b, t, h, dv), ht, k.new_empty(b * triton.cdiv(t, BT), h, dk, dv)


@torch.library.custom_op("hilo::linear_attn_backward", mutates_args=())
@dense_outputs
def _linear_attn_backward_op(do: torch.Tensor, dht: Optional[torch.Tensor], q: torch.Tensor,  # noqa: UP045
                             k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],  # noqa: UP045
                             h0: Optional[torch.Tensor], hs: torch.Tensor,  # noqa: UP045
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                    torch.Tensor]:
    """(dq, dk, dv, dg (empty without g), dh0 (empty without h0)) in their inputs' dtypes."""
    b, t, groups, _ = q.shape
    h, dv = v.shape[2], v.shape[3]
    qg, kg, vf, gf, h0f, lay = _flat_inputs(q, k, v, g, h0)
    do = do.reshape(b * t, h, dv).contiguous().to(vf.dtype)
    dht = None if dht is None else dht.contiguous().float()
    dq, dk_, dv_, dg, dh0 = chunk_bwd(qg, kg, vf, gf, do, dht, hs, scale, h0f, lay, need_dh0=h0 is not None)
    dq, dk_ = _group_grad(dq, groups, q.dtype), _group_grad(dk_, groups, k.dtype)
    return (dq.reshape(q.shape), dk_.reshape(k.shape), dv_.reshape(v.shape).to(v.dtype),
            absent_grad(q) if g is None else dg.reshape(g.shape).to(g.dtype),
            absent_grad(q) if h0 is None else dh0.to(h0.dtype))


@_linear_attn_backward_op.register_fake
def _(do, dht, q, k, v, g, h0, hs, scale):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            absent_grad(q) if g is None else g.new_empty(g.shape),
            absent_grad(q) if h0 is None else h0.new_empty(h0.shape))


def _linear_attn_setup(ctx, inputs, output):
    q, k, v, g, h0, scale, output_final_state = inputs
    _, _, hs = output
    ctx.save_for_backward(q, k, v, g, h0, hs)
    ctx.scale, ctx.output_final_state = scale, output_final_state
    unused_grads_stay_none(ctx, output)


def _linear_attn_grads(ctx, do, dht, _dhs):
    q, k, v, g, h0, hs = ctx.saved_tensors
    do = grad_or_zeros(ctx, do)
    dht = dht if ctx.output_final_state else None
    dq, dk, dv, dg, dh0 = _linear_attn_backward_op(do, dht, q, k, v, g, h0, hs, ctx.scale)
    return dq, dk, dv, (dg if g is not None else None), (dh0 if h0 is not None else None), None, None


_linear_attn_op.register_autograd(_linear_attn_grads, setup_context=_linear_attn_setup)


def linear_attn_triton(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens):
    """Triton backend of hilo_kernels.linear_attn (forward and backward kernels); returns (o, final_state)."""
    if cu_seqlens is None:
        o, ht, _ = _linear_attn_op(q.contiguous(), k.contiguous(), v.contiguous(),
                                   None if g is None else g.contiguous(), initial_state, scale, output_final_state)
        return o, (ht if output_final_state else None)
    o, ht = LinearAttnFunction.apply(q, k, v, g, initial_state, cu_seqlens, scale, output_final_state)
    return o, (ht if output_final_state else None)
