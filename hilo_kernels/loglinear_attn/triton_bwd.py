"""Triton backward of log-linear attention, the autograd.Function tying it to triton_fwd, and the backend entry.

The chunk levels go through triton_nodes (forward and backward); `_intra_bwd`, one program per (chunk, head), takes
the levels 0..6 (notation of triton_fwd; P[t, s] = scale q_t.k_s exp(gc_t - gc_s) [s <= t], W[t, s] = P * Lambda):
dW = do v^T, dv = W^T do, dlambda_t[l] = sum_{s: level l} (dW * P)[t, s] for l = 0..6, dP = dW * Lambda,
dq = dP k * ..., dk = dP^T q * ... (plain stores, fp32).
Gate gradient: every decay is exp(G_t - G_s) with q_t carrying exp(G_t) and k_s exp(-G_s) (G the in-document
cumsum of g), so dL/dG_t = q_t . dq_t - k_t . dk_t (+ sum_j <R_j, dR_j> of the final chunk-level states at a
document's last token), and dg_t = sum_{s >= t in its document} dL/dG_s (as hilo_kernels.linear_attn.triton_bwd).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from hilo_kernels.common.compile import dense_outputs

from .state import CHUNK_LEVELS, prior_level, segments
from .triton_fwd import (
    CHUNK,
    LevelLayout,
    _chunk_rows,
    _in_chunk_lambda,
    _in_chunk_levels,
    dot_precision,
    intra_fwd,
    last_chunk_levels,
    level_layout,
    pow2,
)
from .triton_nodes import node_scan_bwd, node_scan_fwd


@triton.jit(do_not_specialize=["NL"])
def _intra_bwd(q, k, v, g, lam, do, dq, dk, dv, dlam, chunks, scale, NL,
               H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, HAS_G: tl.constexpr, PREC: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    base, lo, hi = _chunk_rows(chunks, i_c)
    o_t = base + tl.arange(0, C)
    m_t = (o_t >= lo) & (o_t < hi)
    o_k = tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k[None, :] < K)
    qb = tl.load(q + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
    kb = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
    o_i = tl.arange(0, C)
    causal = o_i[:, None] >= o_i[None, :]
    if HAS_G:
        gc = tl.cumsum(tl.load(g + o_t * H + i_h, mask=m_t, other=0.0).to(tl.float32), 0)
        decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf"))) * scale
    else:
        decay = tl.where(causal, scale, 0.0)
    p = tl.dot(qb, tl.trans(kb), input_precision=PREC) * decay
    lev = _in_chunk_levels(C)
    lam_mat = _in_chunk_lambda(lam, o_t, m_t, i_h, lev, NL, H, C)
    w_t = tl.trans(p * lam_mat)
    d_w = tl.zeros([C, C], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v[None, :] < V)
        vb = tl.load(v + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0)
        dob = tl.load(do + (o_t[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0)
        d_w += tl.dot(dob, tl.trans(vb), input_precision=PREC)
        dvb = tl.dot(w_t.to(dob.dtype), dob, input_precision=PREC)
        tl.store(dv + (o_t[:, None] * H + i_h) * V + o_v[None, :], dvb, mask=m_tv)
    d_lam = d_w * p
    for lv in tl.static_range(0, 7):
        tl.store(dlam + (o_t * H + i_h) * NL + lv, tl.sum(tl.where(lev == lv, d_lam, 0.0), 1),
                 mask=m_t & ((tl.zeros_like(o_t) + lv) < NL))
    d_s = (d_w * lam_mat * decay).to(qb.dtype)
    tl.store(dq + (o_t[:, None] * H + i_h) * K + o_k[None, :], tl.dot(d_s, kb, input_precision=PREC), mask=m_tk)
    tl.store(dk + (o_t[:, None] * H + i_h) * K + o_k[None, :], tl.dot(tl.trans(d_s), qb, input_precision=PREC),
             mask=m_tk)


def _segment_reverse_cumsum(x: torch.Tensor, lay: LevelLayout) -> torch.Tensor:
    """dg_t = sum_{s >= t in t's document} x_s for x [TT, H] (float64 scan along the token axis)."""
    xt = x.t().to(torch.float64)
    csum = torch.cumsum(xt, 1)
    last = lay.last_of_seq[lay.seq_of_token]
    return (csum[:, last] - csum + xt).t().to(torch.float32)


def _loglinear_forward(q, k, v, g, lam, lay, scale, want_final):
    """The kernels' forward: (o fp32 [B, T, H, V], final chunk-level states or None, what the backward needs: the
    flat inputs; the backward recomputes the nodes)."""
    b, t, h, _ = q.shape
    dv = v.shape[-1]
    qf, kf, vf = (x.reshape(b * t, h, x.shape[-1]).contiguous() for x in (q, k, v))
    gf = None if g is None else g.reshape(b * t, h).float().contiguous()
    lf = lam.reshape(b * t, h, lam.shape[-1]).float().contiguous()
    o = torch.empty(b * t, h, dv, device=q.device, dtype=torch.float32)
    intra_fwd(qf, kf, vf, gf, lf, scale, lay, o)
    rfin = None
    if lay.nj:
        rfin = node_scan_fwd(qf, kf, vf, gf, lf, scale, lay, o, want_final)
    return o.reshape(b, t, h, dv), rfin, (qf, kf, vf, gf, lf)


def _loglinear_backward(saved, rfin, lay, scale, shape, do, drfin):
    """(dq, dk, dv fp32 or in the inputs' dtype, dg or None, dlam fp32) flat, from the forward's saved tensors."""
    qf, kf, vf, gf, lf = saved
    b, t, h, dk_, dv_ = shape
    do = do.reshape(b * t, h, dv_).to(vf.dtype).contiguous()
    # the intra kernel stores every real token's dq, dk, dv (each token is in one chunk row)
    alloc = torch.empty if lay.rows else torch.zeros
    dq = alloc(b * t, h, dk_, device=qf.device, dtype=torch.float32)
    dk = alloc(b * t, h, dk_, device=qf.device, dtype=torch.float32)
    dv = alloc(b * t, h, dv_, device=qf.device, dtype=torch.float32)
    dlam = torch.zeros_like(lf)
    nl = lf.shape[-1]
    prec = dot_precision(qf.dtype)
    gate = gf if gf is not None else qf
    if lay.rows:
        _intra_bwd[(lay.rows, h)](qf, kf, vf, gate, lf, do, dq, dk, dv, dlam, lay.chunks, scale, nl, H=h, K=dk_,
                                  V=dv_, C=CHUNK, BK=pow2(dk_), BV=min(64, pow2(dv_)), HAS_G=gf is not None,
                                  PREC=prec, num_warps=8, num_stages=1)
    has_drfin = drfin is not None and rfin is not None
    d_big_g = None
    if lay.nj:
        # the node form's gradient kernel finishes dq, dk, dv (in the input dtype) and dL/dG_t itself
        dq, dk, dv, d_big_g = node_scan_bwd(qf, kf, vf, gf, lf, do, drfin if has_drfin else None, scale, lay, dq,
                                            dk, dv, dlam)
    dg = None
    if gf is not None:
        if d_big_g is None:
            d_big_g = (qf.float() * dq).sum(-1) - (kf.float() * dk).sum(-1)
        if has_drfin:
            term = (rfin * drfin).sum((2, 3, 4)) * lay.nonempty_mask[:, None]
            d_big_g = d_big_g.index_add(0, lay.last_of_seq, term)
        dg = _segment_reverse_cumsum(d_big_g, lay).reshape(b, t, h)
    return (dq.reshape(b, t, h, dk_).to(qf.dtype), dk.reshape(b, t, h, dk_).to(kf.dtype),
            dv.reshape(b, t, h, dv_).to(vf.dtype), dg, dlam.reshape(b, t, h, nl))


class LogLinearAttnFunction(torch.autograd.Function):
    """(q, k, v, g, lam) -> (o fp32 [B, T, H, V] without the prior levels' reads, final chunk-level states
    [N, H, nj, K, V] fp32 or None)."""

    @staticmethod
    def forward(ctx, q, k, v, g, lam, lay, scale, want_final):
        o, rfin, saved = _loglinear_forward(q, k, v, g, lam, lay, scale, want_final)
        ctx.save_for_backward(*saved, rfin)
        ctx.lay, ctx.scale, ctx.shape, ctx.lam_dtype = lay, scale, (*q.shape, v.shape[-1]), lam.dtype
        return o, rfin

    @staticmethod
    def backward(ctx, do, drfin):
        *saved, rfin = ctx.saved_tensors
        dq, dk, dv, dg, dlam = _loglinear_backward(saved, rfin, ctx.lay, ctx.scale, ctx.shape, do, drfin)
        return dq, dk, dv, dg, dlam.to(ctx.lam_dtype), None, None, None


# Fixed-length calls without an initial or final state (what training makes) are also a torch.library custom op pair:
# a compiled graph holds the operator as one node instead of breaking around it. The layout (host tables) is built
# inside the op from the shapes alone, and the backward recomputes the nodes. Calls with priors, final states or packed documents keep the Function (they read
# tokens / boundaries on the host and return the levels through torch code).
def _fixed_layout(q):
    b, t = q.shape[:2]
    return level_layout(tuple(segments(b, t, None)), (0,) * b, t, q.device)


@torch.library.custom_op("hilo::loglinear_attn", mutates_args=())
@dense_outputs
def _loglinear_attn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],  # noqa: UP045
                       lam: torch.Tensor, scale: float) -> torch.Tensor:
    """o fp32 [B, T, H, V]."""
    return _loglinear_forward(q, k, v, g, lam, _fixed_layout(q), scale, False)[0]


@_loglinear_attn_op.register_fake
def _(q, k, v, g, lam, scale):
    return v.new_empty(v.shape, dtype=torch.float32)


@torch.library.custom_op("hilo::loglinear_attn_backward", mutates_args=())
@dense_outputs
def _loglinear_attn_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                g: Optional[torch.Tensor], lam: torch.Tensor,  # noqa: UP045
                                scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                       torch.Tensor]:
    """(dq, dk, dv in their inputs' dtypes, dg (empty without g), dlam in lam's dtype)."""
    b, t, h, _ = q.shape
    flat = [x.reshape(b * t, h, x.shape[-1]).contiguous() for x in (q, k, v)]
    gf = None if g is None else g.reshape(b * t, h).float().contiguous()
    lf = lam.reshape(b * t, h, lam.shape[-1]).float().contiguous()
    saved = (*flat, gf, lf)
    dq, dk, dv, dg, dlam = _loglinear_backward(saved, None, _fixed_layout(q), scale, (*q.shape, v.shape[-1]), do,
                                               None)
    return dq, dk, dv, (q.new_empty(0, dtype=torch.float32) if dg is None else dg.to(g.dtype)), dlam.to(lam.dtype)


@_loglinear_attn_backward_op.register_fake
def _(do, q, k, v, g, lam, scale):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(0, dtype=torch.float32) if g is None else g.new_empty(g.shape), lam.new_empty(lam.shape))


def _loglinear_attn_setup(ctx, inputs, output):
    q, k, v, g, lam, scale = inputs
    ctx.save_for_backward(q, k, v, g, lam)
    ctx.scale = scale


def _loglinear_attn_grads(ctx, do):
    q, k, v, g, lam = ctx.saved_tensors
    dq, dk, dv, dg, dlam = _loglinear_attn_backward_op(do, q, k, v, g, lam, ctx.scale)
    return dq, dk, dv, (dg if g is not None else None), dlam, None


_loglinear_attn_op.register_autograd(_loglinear_attn_grads, setup_context=_loglinear_attn_setup)


def _prior_reads(q, g, lam, prior, segs, starts, scale):
    """scale * sum_l lambda_t[max(l, bit_length(t xor (p0 - 1)))] exp(G_t) q_t^T prior_l for every sequence that
    continues a state (p0 > 0): [B, T, H, V] fp32, or None when no sequence does (torch, differentiable)."""
    b, t, h, dk = q.shape
    nl = lam.shape[-1]
    out = None
    for n, (row, s, e) in enumerate(segs):
        if starts[n] == 0 or e == s:
            continue
        if out is None:
            out = q.new_zeros(b, t, h, prior.shape[-1], dtype=torch.float32)
        pos = starts[n] + torch.arange(e - s, device=q.device)
        idx = prior_level(pos, starts[n], nl)  # [len, L]
        lam_p = torch.gather(lam[row, s:e].float(), 2, idx[:, None, :].expand(e - s, h, nl))  # [len, H, L]
        if g is not None:
            lam_p = lam_p * g[row, s:e].float().cumsum(0).exp()[..., None]
        u = (lam_p[..., None] * q[row, s:e].float()[:, :, None, :]).transpose(0, 1).reshape(h, e - s, nl * dk)
        out[row, s:e] = scale * (u @ prior[n].float().reshape(h, nl * dk, -1)).transpose(0, 1)
    return out


def _final_levels(k, v, g, rfin, prior, lay: LevelLayout, nl):
    """The final LogLinearState levels [N, H, L, K, V] fp32 (torch, differentiable, batched over sequences):
    levels 0..6 from each sequence's last chunk, levels 7.. from the level scan, plus the prior levels moved to
    their bucket as seen from the last position (see chunk.py)."""
    h = k.shape[1]
    offs = torch.arange(CHUNK, device=k.device)
    tok = lay.last_of_seq[:, None] - lay.end_offsets[:, None] + offs[None, :]  # [N, C]: the last chunk's offsets
    valid = (offs[None, :] <= lay.end_offsets[:, None]) & (tok >= lay.first_tokens[:, None])
    valid = valid & lay.nonempty_mask[:, None]
    tok = torch.where(valid, tok, torch.zeros_like(tok))
    kd = k[tok].float() * valid[..., None, None]  # [N, C, H, K]
    vv = v[tok].float()
    if g is not None:
        gw = g[tok].float() * valid[..., None]  # [N, C, H]
        kd = kd * (gw.sum(1, keepdim=True) - gw.cumsum(1)).exp()[..., None]
    final = last_chunk_levels(kd, vv, lay, nl)
    if lay.nj:
        final = torch.cat([final[:, :, : CHUNK_LEVELS + 1],
                           final[:, :, CHUNK_LEVELS + 1: CHUNK_LEVELS + 1 + lay.nj] + rfin[:, :, : lay.nj],
                           final[:, :, CHUNK_LEVELS + 1 + lay.nj:]], 2)
    if prior is not None:
        moved = prior.float()
        if g is not None:
            total = g.float().new_zeros(lay.n, h).index_add(0, lay.seq_of_token, g.float())
            moved = moved * total.exp()[:, :, None, None, None]
        final = final + torch.einsum("nlm,nhlkv->nhmkv", lay.prior_moves(nl, k.device), moved)
    return final


def loglinear_attn_triton(q, k, v, g, level_scales, scale, initial_state, output_final_state, cu_seqlens, starts):
    """Triton backend of hilo_kernels.loglinear_attn: returns (o [B, T, H, V] in q's dtype, final levels
    [N, H, L, K, V] fp32 or None). The kernels compute everything a call's own tokens contribute; an initial
    state's reads and the final levels 0..6 are torch code around them (exact, differentiable)."""
    b, t = q.shape[:2]
    if cu_seqlens is None and not output_final_state and not any(starts):
        o = _loglinear_attn_op(q.contiguous(), k.contiguous(), v.contiguous(), g, level_scales.contiguous(), scale)
        return o.to(q.dtype), None
    nl = level_scales.shape[-1]
    segs = segments(b, t, cu_seqlens)
    lay = level_layout(tuple(segs), tuple(starts), t, q.device)
    o, rfin = LogLinearAttnFunction.apply(q, k, v, g, level_scales, lay, scale, output_final_state)
    prior = None
    if initial_state is not None and any(p > 0 for p in starts):
        prior = initial_state.levels
        extra = _prior_reads(q, g, level_scales, prior, segs, starts, scale)
        if extra is not None:
            o = o + extra
    final = None
    if output_final_state:
        flat = (lambda x: None if x is None else x.reshape(b * t, *x.shape[2:]))
        final = _final_levels(flat(k), flat(v), flat(g), rfin, prior, lay, nl)
    return o.to(q.dtype), final
