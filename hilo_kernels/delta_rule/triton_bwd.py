"""Triton backward of the gated delta rule, and the torch.library custom op pair that ties it to triton_fwd.

With the forward's per-chunk quantities (chunk.py's notation; S the chunk-start state, S' the chunk-end state):
  O = scale (diag(e^gamma) Q S + P U),  P = Q K^T * Gamma * M,    S' = e^{gamma_C} S + Kbar^T U,
  U = U~ - W S,  W = T X,  U~ = T Y,  X = diag(beta e^gamma) K,  Y = diag(beta) V,  T = (I + A)^{-1},
the gradients are, going backwards through the chunks with dS' (the gradient at the chunk end):
  dU = scale P^T dO + Kbar dS',     dS = e^{gamma_C} dS' + scale (diag(e^gamma) Q)^T dO - W^T dU,
and then, chunk by chunk in parallel: dW = -dU S^T, dX = T^T dW, dY = T^T dU, dT = dW X^T + dU Y^T,
dA = -T^T dT T^T (strictly lower part), plus the direct terms of Q, K, beta and gamma; dg is the reverse
cumsum of dgamma inside the chunk. Launches:
  1. intra (per (chunk, head, V-block)): dU_intra = scale P^T dO;
  2. reverse state pass (per (document, head, V-block)): dS' per chunk, dU, and the initial-state gradient;
  3. grads (per (chunk, head)): everything else in one program, with dA = -dY U^T (see _grads_kernel): dW, dgamma
     and the partial dk never go through HBM.
The forward's chunk states, pseudo-values, U~, W and T are saved, not recomputed.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from hilo_kernels.common.compile import absent_grad, dense_outputs, grad_or_zeros, unused_grads_stay_none
from hilo_kernels.common.launch import current
from hilo_kernels.common.varlen import chunk_table, sequence_bounds

from .triton_fwd import CHUNK, block_sizes, delta_rule_fwd, dot_precision, state_block_v, state_stages


@triton.jit
def _intra_kernel(
    q_ptr, k_ptr, gamma_ptr, do_ptr, table_ptr, du_ptr, scale,
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
    mk = rmask[:, None] & (offs_k < K)[None, :]
    m2 = rmask[:, None] & (offs_v < V)[None, :]
    b_q = tl.load(q_ptr + (tok[:, None] * H + pid_h) * K + offs_k[None, :], mask=mk, other=0.0)
    b_k = tl.load(k_ptr + (tok[:, None] * H + pid_h) * K + offs_k[None, :], mask=mk, other=0.0)
    b_gamma = tl.load(gamma_ptr + tok * H + pid_h, mask=rmask, other=0.0)
    b_do = tl.load(do_ptr + (tok[:, None] * H + pid_h) * V + offs_v[None, :], mask=m2, other=0.0)
    # padded rows (past the end) masked out: their exp(gamma_i - gamma_j) can overflow (docs/kernels.md)
    incl = (rows[:, None] >= rows[None, :]) & rmask[:, None]
    decay = tl.exp(tl.where(incl, b_gamma[:, None] - b_gamma[None, :], float("-inf")))
    # P^T = K Q^T * Gamma^T: build it transposed directly so no transposed tile is materialised.
    b_pt = tl.dot(b_k, tl.trans(b_q), input_precision=PREC) * tl.trans(decay) * scale
    b_du = tl.dot(b_pt.to(b_do.dtype), b_do, input_precision=PREC)
    tl.store(du_ptr + (tok[:, None] * H + pid_h) * V + offs_v[None, :], b_du.to(du_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _state_bwd_kernel(
    q_ptr, k_ptr, gamma_ptr, w_ptr, do_ptr, du_ptr, bounds_ptr, choff_ptr, dht_ptr,
    dh_ptr, dh0_ptr, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PREC: tl.constexpr,
):
    """Reverse pass over a document's chunks, reading dU_intra from the intra kernel's output. scale e^gamma goes on
    dO rather than on Q, and the decay of Kbar dS' on K: on sm_90 (Triton 3.9, 8 warps) that spills least (BV 64:
    32 B against 320 B with both on K and 136 B with both on the [C, BV] tiles)."""
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

    dstate = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dstate += tl.load(dht_ptr + (pid_n * H + pid_h) * K * V + s_off, mask=smask, other=0.0)
    for ci in range(nch):
        c = nch - 1 - ci
        start = bos + c * C
        tok = start + rows
        rmask = tok < eos
        last = tl.minimum(start + C, eos) - 1
        tl.store(dh_ptr + ((c0 + c) * H + pid_h) * K * V + s_off, dstate.to(dh_ptr.dtype.element_ty), mask=smask)
        mk = rmask[:, None] & kmask[None, :]
        m2 = rmask[:, None] & vmask[None, :]
        b_k = tl.load(k_ptr + (tok[:, None] * H + pid_h) * K + offs_k[None, :], mask=mk, other=0.0)
        b_q = tl.load(q_ptr + (tok[:, None] * H + pid_h) * K + offs_k[None, :], mask=mk, other=0.0)
        b_w = tl.load(w_ptr + (tok[:, None] * H + pid_h) * K + offs_k[None, :], mask=mk, other=0.0)
        b_gamma = tl.load(gamma_ptr + tok * H + pid_h, mask=rmask, other=0.0)
        g_last = tl.load(gamma_ptr + last * H + pid_h)
        b_do = tl.load(do_ptr + (tok[:, None] * H + pid_h) * V + offs_v[None, :], mask=m2, other=0.0)
        b_du = tl.load(du_ptr + (tok[:, None] * H + pid_h) * V + offs_v[None, :], mask=m2,
                       other=0.0).to(tl.float32)
        b_kbar = (b_k.to(tl.float32) * tl.exp(g_last - b_gamma)[:, None]).to(b_k.dtype)
        b_du += tl.dot(b_kbar, dstate.to(b_k.dtype), input_precision=PREC)
        tl.store(du_ptr + (tok[:, None] * H + pid_h) * V + offs_v[None, :], b_du.to(du_ptr.dtype.element_ty),
                 mask=m2)
        b_dod = (b_do.to(tl.float32) * (tl.exp(b_gamma) * scale)[:, None]).to(b_do.dtype)
        dstate = dstate * tl.exp(g_last) + tl.dot(tl.trans(b_q), b_dod, input_precision=PREC)
        dstate -= tl.dot(tl.trans(b_w), b_du.to(b_w.dtype), input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0_ptr + (pid_n * H + pid_h) * K * V + s_off, dstate, mask=smask)


@triton.jit
def _grads_kernel(
    q_ptr, k_ptr, v_ptr, beta_ptr, gamma_ptr, tinv_ptr, u_ptr, h_ptr, dh_ptr, do_ptr, du_ptr, table_ptr,
    dq_ptr, dk_ptr, dv_ptr, dbeta_ptr, dg_ptr, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr, BV2: tl.constexpr,
    HAS_G: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr,
):
    """The backward's chunk-parallel part in one program per (chunk, head): dq, dk, dv, dbeta, dg; dW, dgamma and
    partial dk stay in registers.

    dA needs no pass over W: dA = -(dX W^T + dY U~^T) with dX W^T = T^T dW W^T = -T^T dU S^T W^T = -dY (W S)^T,
    and U = U~ - W S, so dA = -dY U^T (U the forward's pseudo-values). So dA, dv and the dbeta term of Y come from
    one pass over V (with dP = dO U^T), K K^T and Q K^T from one pass over K, and then each K-block of dq and dk is
    final after its own inner pass over V (dW = -dU S^T, dX = T^T dW)."""
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
    b_gamma = tl.load(gamma_ptr + tok * H + pid_h, mask=rmask, other=0.0)
    last = end - start - 1
    g_last = tl.load(gamma_ptr + (end - 1) * H + pid_h)
    dt = q_ptr.dtype.element_ty
    # Operand dtype of the UT-transform products: the input dtype under LOWP (fp32 accumulation), else fp32.
    mdt = dt if LOWP else tl.float32
    h_base = pid_c.to(tl.int64) * H * K * V + pid_h * K * V
    # T^T loaded transposed: b_tt[i, j] = T[j, i] (T is stored one row per token).
    b_tt = tl.load(tinv_ptr + (tok[None, :] * H + pid_h) * C + rows[:, None], mask=rmask[None, :],
                   other=0.0).to(mdt)

    # Pass over V: dP = dO U^T; dY = T^T dU -> dv = diag(beta) dY, dbeta (Y term), dA = -dY U^T.
    b_dp = tl.zeros([C, C], dtype=tl.float32)
    b_da = tl.zeros([C, C], dtype=tl.float32)
    b_dbeta = tl.zeros([C], dtype=tl.float32)
    for v0 in range(0, V, BV):
        offs_v = v0 + tl.arange(0, BV)
        m2 = rmask[:, None] & (offs_v < V)[None, :]
        vptrs = (tok[:, None] * H + pid_h) * V + offs_v[None, :]
        b_do = tl.load(do_ptr + vptrs, mask=m2, other=0.0)
        b_u = tl.load(u_ptr + vptrs, mask=m2, other=0.0)
        b_du = tl.load(du_ptr + vptrs, mask=m2, other=0.0).to(mdt)
        b_v = tl.load(v_ptr + vptrs, mask=m2, other=0.0).to(tl.float32)
        b_dp += tl.dot(b_do, tl.trans(b_u), input_precision=PREC)
        b_dy = tl.dot(b_tt, b_du, input_precision=PREC)
        tl.store(dv_ptr + vptrs, (b_dy * b_beta[:, None]).to(dv_ptr.dtype.element_ty), mask=m2)
        b_dbeta += tl.sum(b_dy * b_v, 1)
        b_da -= tl.dot(b_dy.to(mdt), tl.trans(b_u.to(mdt)), input_precision=PREC)
    # Pass over K: Q K^T and K K^T.
    b_qk = tl.zeros([C, C], dtype=tl.float32)
    b_kk = tl.zeros([C, C], dtype=tl.float32)
    for k0 in range(0, K, KB):
        offs_k = k0 + tl.arange(0, KB)
        mk = rmask[:, None] & (offs_k < K)[None, :]
        kptrs = (tok[:, None] * H + pid_h) * K + offs_k[None, :]
        b_k = tl.load(k_ptr + kptrs, mask=mk, other=0.0)
        b_qk += tl.dot(tl.load(q_ptr + kptrs, mask=mk, other=0.0), tl.trans(b_k), input_precision=PREC)
        b_kk += tl.dot(b_k, tl.trans(b_k), input_precision=PREC)
    # padded rows (past the end) masked out: their exp(gamma_i - gamma_j) can overflow (docs/kernels.md)
    incl = (rows[:, None] >= rows[None, :]) & rmask[:, None]
    decay = tl.exp(tl.where(incl, b_gamma[:, None] - b_gamma[None, :], float("-inf")))
    e_gamma = tl.exp(b_gamma)
    e_end = tl.where(rmask, tl.exp(g_last - b_gamma), 0.0)
    # Intra-chunk output term P = scale Q K^T * Gamma * M.
    b_e = b_dp * b_qk * decay * scale
    b_dgam = tl.sum(b_e, 1) - tl.sum(b_e, 0)
    b_dpm = (b_dp * decay * scale).to(dt)
    # A = diag(beta) (K K^T * Gamma) on the strictly lower part.
    # padded rows (past the end) masked out: their exp(gamma_i - gamma_j) can overflow (docs/kernels.md)
    strict = (rows[:, None] > rows[None, :]) & rmask[:, None]
    dstrict = tl.exp(tl.where(strict, b_gamma[:, None] - b_gamma[None, :], float("-inf")))
    b_kkd = b_kk * dstrict
    b_da = tl.where(strict, b_da, 0.0)
    b_dbeta += tl.sum(b_da * b_kkd, 1)
    b_d = b_da * b_kkd * b_beta[:, None]
    b_dgam += tl.sum(b_d, 1) - tl.sum(b_d, 0)
    b_ga = (b_da * b_beta[:, None] * dstrict).to(mdt)
    # X = diag(beta e^gamma) K.
    b_xw = b_beta * e_gamma
    b_glast = tl.zeros([C], dtype=tl.float32)

    for k0 in range(0, K, KB):
        offs_k = k0 + tl.arange(0, KB)
        kmask = offs_k < K
        mk = rmask[:, None] & kmask[None, :]
        kptrs = (tok[:, None] * H + pid_h) * K + offs_k[None, :]
        b_dqs = tl.zeros([C, KB], dtype=tl.float32)
        b_kb = tl.zeros([C, KB], dtype=tl.float32)
        b_dw = tl.zeros([C, KB], dtype=tl.float32)
        b_dgl = tl.zeros([KB], dtype=tl.float32)
        for v0 in range(0, V, BV2):
            offs_v = v0 + tl.arange(0, BV2)
            vmask = offs_v < V
            m2 = rmask[:, None] & vmask[None, :]
            vptrs = (tok[:, None] * H + pid_h) * V + offs_v[None, :]
            b_do = tl.load(do_ptr + vptrs, mask=m2, other=0.0)
            b_u = tl.load(u_ptr + vptrs, mask=m2, other=0.0)
            b_du = tl.load(du_ptr + vptrs, mask=m2, other=0.0).to(dt)
            smask = kmask[:, None] & vmask[None, :]
            s_off = h_base + offs_k[:, None] * V + offs_v[None, :]
            b_h = tl.load(h_ptr + s_off, mask=smask, other=0.0)
            b_dh = tl.load(dh_ptr + s_off, mask=smask, other=0.0)
            b_dqs += tl.dot(b_do, tl.trans(b_h), input_precision=PREC)
            b_kb += tl.dot(b_u, tl.trans(b_dh), input_precision=PREC)
            b_dw -= tl.dot(b_du, tl.trans(b_h), input_precision=PREC)
            b_dgl += tl.sum(b_dh.to(tl.float32) * b_h.to(tl.float32), 1)
        b_q = tl.load(q_ptr + kptrs, mask=mk, other=0.0)
        b_k = tl.load(k_ptr + kptrs, mask=mk, other=0.0)
        b_dq = b_dqs * (e_gamma * scale)[:, None] + tl.dot(b_dpm, b_k, input_precision=PREC)
        tl.store(dq_ptr + kptrs, b_dq.to(dq_ptr.dtype.element_ty), mask=mk)
        b_dx = tl.dot(b_tt, b_dw.to(mdt), input_precision=PREC)
        # Output term, state write Kbar^T U (Kbar = diag(e^{gamma_C - gamma}) K), X and A terms.
        b_dk = tl.dot(tl.trans(b_dpm), b_q, input_precision=PREC) + b_kb * e_end[:, None] + b_dx * b_xw[:, None]
        b_km = b_k.to(mdt)
        b_dk += tl.dot(b_ga, b_km, input_precision=PREC) + tl.dot(tl.trans(b_ga), b_km, input_precision=PREC)
        tl.store(dk_ptr + kptrs, b_dk.to(dk_ptr.dtype.element_ty), mask=mk)
        b_kf = b_k.to(tl.float32)
        b_dgam += e_gamma * scale * tl.sum(b_q.to(tl.float32) * b_dqs, 1)
        b_term = e_end * tl.sum(b_kf * b_kb, 1)
        b_dgam -= b_term
        b_glast += tl.exp(g_last) * tl.sum(b_dgl, 0) + tl.sum(b_term, 0)
        b_tmp = e_gamma * tl.sum(b_dx * b_kf, 1)
        b_dbeta += b_tmp
        b_dgam += b_beta * b_tmp
    b_dgam += tl.where(rows == last, b_glast, 0.0)
    tl.store(dbeta_ptr + tok * H + pid_h, b_dbeta, mask=rmask)
    if HAS_G:
        b_dgam = tl.where(rmask, b_dgam, 0.0)
        b_dg = tl.sum(b_dgam, 0) - tl.cumsum(b_dgam, axis=0) + b_dgam
        tl.store(dg_ptr + tok * H + pid_h, b_dg, mask=rmask)


def grads_launch() -> dict:
    """num_warps, num_stages and (when capped) maxnreg of the fused backward kernel (hilo_kernels.common.launch)."""
    launch = current("delta_rule")
    out = {"num_warps": launch.grads_warps, "num_stages": launch.grads_stages}
    if launch.grads_maxnreg:
        out["maxnreg"] = launch.grads_maxnreg
    return out


def delta_rule_bwd(q, k, v, beta, g, scale, want_dh0, bounds, table, choff, saved, do, dht):
    """Gradients (dq, dk, dv, dbeta fp32, dg fp32 or None, dh0 fp32 or None unless want_dh0) on the packed
    [L, H, *] layout."""
    gamma, tinv, w, u, hs = saved
    total, h, dk = q.shape
    dv = v.shape[-1]
    n = bounds.numel() - 1
    rows = table.shape[0]
    bk, bv = block_sizes(dk, dv)
    prec = dot_precision(q.dtype)
    dev = q.device
    low = q.dtype != torch.float32  # 16-bit inputs: input-dtype dot operands and dU (fp32 accumulation)
    launch = current("delta_rule")
    du = torch.empty(total, h, dv, device=dev, dtype=q.dtype if low else torch.float32)
    sbv = state_block_v(dk, dv, n * h, dev, "state_bwd")
    _intra_kernel[(triton.cdiv(dv, bv), rows, h)](
        q, k, gamma, do, table, du, scale, H=h, K=dk, V=dv, C=CHUNK, BK=bk, BV=bv, PREC=prec,
        num_warps=launch.intra_warps,
    )
    dh = torch.empty(rows, h, dk, dv, device=dev, dtype=q.dtype)
    dh0 = torch.empty(n, h, dk, dv, device=dev, dtype=torch.float32) if want_dh0 else None
    _state_bwd_kernel[(triton.cdiv(dv, sbv), h, n)](
        q, k, gamma, w, do, du, bounds, choff, dht if dht is not None else gamma,
        dh, dh0 if dh0 is not None else gamma, scale,
        H=h, K=dk, V=dv, C=CHUNK, BK=bk, BV=sbv, HAS_DHT=dht is not None, STORE_DH0=dh0 is not None,
        PREC=prec, num_warps=launch.state_bwd_warps, num_stages=state_stages(bk, q.element_size(), sbv),
    )
    dq = torch.empty_like(q)
    bv_full = max(16, triton.next_power_of_2(dv))
    dkk = torch.empty_like(k)
    dvv = torch.empty_like(v)
    dbeta = torch.empty(total, h, device=dev, dtype=torch.float32)
    dg = torch.empty(total, h, device=dev, dtype=torch.float32) if g is not None else None
    _grads_kernel[(rows, h)](
        q, k, v, beta, gamma, tinv, u, hs, dh, do, du, table, dq, dkk, dvv, dbeta,
        dg if dg is not None else dbeta, scale,
        H=h, K=dk, V=dv, C=CHUNK, KB=min(bk, launch.grads_kb), BV=min(bv_full, launch.grads_bv),
        BV2=min(bv_full, launch.grads_bv2), HAS_G=g is not None, PREC=prec,
        LOWP=low, **grads_launch(),
    )
    return dq, dkk, dvv, dbeta, dg, dh0


# The Triton path as a torch.library custom op pair: shapes never depend on values (the chunk table has a static
# number of rows), so the fakes give every output's shape and a compiled graph holds the operator as one node.
_Tensor = torch.Tensor
_OptTensor = Optional[torch.Tensor]  # noqa: UP045 (custom_op reads the annotations)


@torch.library.custom_op("hilo::delta_rule", mutates_args=())
@dense_outputs
def _delta_rule_op(q: _Tensor, k: _Tensor, v: _Tensor, beta: _Tensor, g: _OptTensor, h0: _OptTensor, scale: float,
                   output_final_state: bool, bounds: _Tensor, table: _Tensor, choff: _Tensor
                   ) -> tuple[_Tensor, _Tensor, _Tensor, _Tensor, _Tensor, _Tensor, _Tensor]:
    """(o [L, H, V], final [N, H, K, V] fp32 (empty unless output_final_state), then the intermediates the backward
    reuses: gamma, tinv, w, u, hs) on the packed [L, H, *] layout."""
    # the kernels index dense rows: a compiled graph may hand the op other strides than eager code does
    q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
    g = None if g is None else g.contiguous()
    h0 = None if h0 is None else h0.contiguous()
    o, final, saved = delta_rule_fwd(q, k, v, beta, g, scale, h0, output_final_state, bounds, table, choff)
    return o, (final if final is not None else q.new_empty(0, dtype=torch.float32)), *saved


@_delta_rule_op.register_fake
def _(q, k, v, beta, g, h0, scale, output_final_state, bounds, table, choff):
    total, h, dk = q.shape
    dv, n, rows = v.shape[-1], bounds.shape[0] - 1, table.shape[0]
    f32 = torch.float32
    final = q.new_empty(n, h, dk, dv, dtype=f32) if output_final_state else q.new_empty(0, dtype=f32)
    return (v.new_empty(total, h, dv), final, q.new_empty(total, h, dtype=f32), q.new_empty(total, h, CHUNK, dtype=f32),
            q.new_empty(total, h, dk), q.new_empty(total, h, dv), q.new_empty(rows, h, dk, dv))


@torch.library.custom_op("hilo::delta_rule_backward", mutates_args=())
@dense_outputs
def _delta_rule_backward_op(do: _Tensor, dht: _OptTensor, q: _Tensor, k: _Tensor, v: _Tensor, beta: _Tensor,
                            g: _OptTensor, h0: _OptTensor, scale: float, want_dh0: bool, bounds: _Tensor,
                            table: _Tensor, choff: _Tensor, gamma: _Tensor, tinv: _Tensor, w: _Tensor, u: _Tensor,
                            hs: _Tensor) -> tuple[_Tensor, _Tensor, _Tensor, _Tensor, _Tensor, _Tensor]:
    """(dq, dk, dv, dbeta in beta's dtype, dg (empty without g), dh0 fp32 (empty unless want_dh0))."""
    q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
    g = None if g is None else g.contiguous()
    dq, dk, dv, dbeta, dg, dh0 = delta_rule_bwd(q, k, v, beta, g, scale, want_dh0, bounds, table, choff,
                                                (gamma, tinv, w, u, hs), do.contiguous(),
                                                None if dht is None else dht.contiguous().float())
    return (dq, dk, dv, dbeta.to(beta.dtype), absent_grad(q) if dg is None else dg.to(g.dtype),
            absent_grad(q) if dh0 is None else dh0)


@_delta_rule_backward_op.register_fake
def _(do, dht, q, k, v, beta, g, h0, scale, want_dh0, bounds, table, choff, gamma, tinv, w, u, hs):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), beta.new_empty(beta.shape),
            absent_grad(q) if g is None else g.new_empty(g.shape),
            h0.new_empty(h0.shape) if want_dh0 else absent_grad(q))


def _delta_rule_setup(ctx, inputs, output):
    q, k, v, beta, g, h0, scale, output_final_state, bounds, table, choff = inputs
    ctx.save_for_backward(q, k, v, beta, g, h0, bounds, table, choff, *output[2:])
    ctx.scale, ctx.output_final_state = scale, output_final_state
    unused_grads_stay_none(ctx, output)


def _delta_rule_grads(ctx, do, dht, *_):
    q, k, v, beta, g, h0, bounds, table, choff, *saved = ctx.saved_tensors
    do = grad_or_zeros(ctx, do)
    want_dh0 = h0 is not None and ctx.needs_input_grad[5]
    dq, dk, dv, dbeta, dg, dh0 = _delta_rule_backward_op(
        do, dht if ctx.output_final_state else None, q, k, v, beta, g, h0, ctx.scale, want_dh0, bounds, table,
        choff, *saved)
    return (dq, dk, dv, dbeta, (dg if g is not None else None), (dh0 if want_dh0 else None), None, None, None, None,
            None)


_delta_rule_op.register_autograd(_delta_rule_grads, setup_context=_delta_rule_setup)


def delta_rule_triton(q, k, v, beta, g, scale, initial_state, output_final_state, cu_seqlens):
    """The public contract (hilo_kernels.delta_rule.delta_rule) on the Triton kernels. No host synchronisation: the
    chunk table is built on the device with a static upper bound on its number of rows."""
    b, t, h, _ = q.shape
    dv = v.shape[-1]
    bounds = sequence_bounds(cu_seqlens, b, t, q.device)
    table, choff = chunk_table(bounds, b * t, CHUNK)
    flat = [x.reshape(b * t, h, -1).contiguous() for x in (q, k, v)]
    beta_f = beta.reshape(b * t, h).contiguous()
    g_f = None if g is None else g.reshape(b * t, h).float().contiguous()
    h0 = None if initial_state is None else initial_state.float().contiguous()
    o, final, *_ = _delta_rule_op(*flat, beta_f, g_f, h0, scale, output_final_state, bounds, table, choff)
    return o.reshape(b, t, h, dv), (final if output_final_state else None)
