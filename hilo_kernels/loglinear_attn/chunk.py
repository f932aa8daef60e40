"""Chunked log-linear attention in PyTorch (docs/kernels.md): exact, differentiable by autograd, the CPU path.

Chunks of C = 64 tokens are aligned to absolute positions (a sequence that starts at position p0 > 0, after an
initial state, is padded in front with p0 mod C inert tokens: k = v = q = 0, g = 0, beta = 0). Then for query t and
source s in chunks c_t, c_s:
    l(t, s) = l(t mod C, s mod C)                 if c_t == c_s  (levels 0..6)
    l(t, s) = 6 + bit_length(c_t XOR c_s)          otherwise
Levels 0..6 are one dense masked C x C block per chunk: O_intra = (E * Lambda) V, E[t, s] = q_t^T P_{t<-s} k_s
(times beta_s for the delta rule), Lambda[t, s] = lambda_t[l(t, s)]. Chunk level j >= 1 (level 6 + j) is one
running K x V state R_j carried over the chunks: at a chunk c with c mod 2^j == 0 it is reset; if bit j-1 of c is
set, chunk c reads it (o_t += lambda_t[6 + j] q_eff_t R_j) and only carries it through its transition; otherwise it
carries it and adds its own write. The chunks with bit j-1 set thus read exactly the 2^(j-1) chunks of the first
half of their 2^j-chunk group, which is bucket 6 + j. All levels are carried in one loop over chunks: cost
O(T K V log(T/C)) plus the O(T C (K + V)) dense blocks.

Per chunk an operator supplies (function `prepare`, see `prepare_linear` and the delta rule's version):
    E [C, C] (causal, decay included), q_eff [C, K] (o_t = q_eff_t S for a state S entering the chunk),
    the transition of a state through the chunk (a scalar decay, or a K x K matrix), local [K, V] (the chunk's own
    contribution to a state at its end) and zcols [K, C] (column s = P_{end<-s} k_s, for the final levels).
A prior state (LogLinearState levels as seen from position p0 - 1) is carried in the same loop as L more slots that
are never written nor reset; query t reads prior level l with weight lambda_t[max(l, bit_length(t XOR (p0-1)))].
"""

import torch
import torch.nn.functional as F

from .state import CHUNK_LEVELS, level_of, prior_level, segments

CHUNK = 1 << CHUNK_LEVELS


def _decay_matrices(gamma):
    """gamma [..., C] in-chunk inclusive cumsum -> exp(gamma_t - gamma_s) on s <= t (0 above), causal mask."""
    c = gamma.shape[-1]
    causal = torch.ones(c, c, dtype=torch.bool, device=gamma.device).tril()
    diff = gamma[..., :, None] - gamma[..., None, :]
    return torch.where(causal, diff, torch.full_like(diff, float("-inf"))).exp(), causal


def prepare_linear(q, k, v, gamma, beta):
    """Per-chunk pieces for linear attention; q, k [b, h, n, C, K], v [.., C, V], gamma [b, h, n, C]."""
    decay, _ = _decay_matrices(gamma)
    e = (q @ k.transpose(-1, -2)) * decay
    q_eff = q * gamma.exp()[..., None]
    kd = k * (gamma[..., -1:] - gamma).exp()[..., None]
    zcols = kd.transpose(-1, -2)
    return e, q_eff, gamma[..., -1].exp(), zcols @ v, zcols


def _carry(z, trans):
    """Apply a chunk transition to the slot states z [b, h, S, K, V]: scalar [b, h] or matrix [b, h, K, K]."""
    if trans.ndim == 2:
        return z * trans[:, :, None, None, None]
    return trans[:, :, None] @ z


def chunk_levels(q, k, v, g, beta, lam, p0, prior, want_final, prepare):
    """One batch of sequences that all start at position p0 (fp32/float64 tensors, q already scaled).

    q, k [b, h, T, K]; v [b, h, T, V]; g, beta [b, h, T] (beta None for linear attention); lam [b, h, T, L];
    prior [b, h, L, K, V] or None. Returns (o [b, h, T, V], final levels [b, h, L, K, V] or None).
    """
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    nl = lam.shape[-1]
    dev = q.device
    if t == 0:
        final = prior if prior is not None else q.new_zeros(b, h, nl, dk, dv)
        return v.new_zeros(b, h, 0, dv), (final if want_final else None)
    front = p0 % CHUNK
    nc = -(-(front + t) // CHUNK)
    back = nc * CHUNK - front - t
    nl_int = max(nl, CHUNK_LEVELS + 1)
    qc, kc, vc = (F.pad(x, (0, 0, front, back)).reshape(b, h, nc, CHUNK, x.shape[-1]) for x in (q, k, v))
    gc = F.pad(g, (front, back)).reshape(b, h, nc, CHUNK)
    bc = None if beta is None else F.pad(beta, (front, back)).reshape(b, h, nc, CHUNK)
    lc = F.pad(lam, (0, nl_int - nl, front, back)).reshape(b, h, nc, CHUNK, nl_int)
    gamma = gc.cumsum(-1)
    e, q_eff, trans, local, zcols = prepare(qc, kc, vc, gamma, bc)

    offs = torch.arange(CHUNK, device=dev)
    lev_in = level_of(offs[:, None], offs[None, :]).clamp(max=nl_int - 1)  # [C, C], upper triangle masked by e
    lam_in = torch.gather(lc, -1, lev_in.expand(b, h, nc, CHUNK, CHUNK))
    o = (e * lam_in) @ vc  # [b, h, nc, C, V]

    c0 = p0 // CHUNK
    c_abs = c0 + torch.arange(nc, device=dev, dtype=torch.int64)
    nj = nl - CHUNK_LEVELS - 1 if nl > CHUNK_LEVELS + 1 else 0
    j = torch.arange(1, nj + 1, device=dev, dtype=torch.int64)
    keep = (c_abs[:, None] % (1 << j)[None] != 0).to(q.dtype)  # [nc, J]
    reads = ((c_abs[:, None] >> (j - 1)[None]) & 1).to(q.dtype)  # [nc, J]
    weights = lc[..., CHUNK_LEVELS + 1: CHUNK_LEVELS + 1 + nj] * reads[None, None, :, None, :]  # [b, h, nc, C, J]
    writes = 1.0 - reads
    z = q.new_zeros(b, h, nj, dk, dv)
    if prior is not None:
        pos = c_abs[:, None] * CHUNK + offs[None, :]  # [nc, C] absolute positions (padding included)
        idx = prior_level(pos.reshape(-1), p0, nl).clamp(max=nl_int - 1).reshape(nc, CHUNK, nl)
        w_prior = torch.gather(lc, -1, idx.expand(b, h, nc, CHUNK, nl))
        weights = torch.cat([weights, w_prior], -1)
        keep = torch.cat([keep, keep.new_ones(nc, nl)], 1)
        writes = torch.cat([writes, writes.new_zeros(nc, nl)], 1)
        z = torch.cat([z, prior.to(q.dtype)], 2)
    if z.shape[2]:
        inter = []
        # per-chunk views taken once by unbind (indexing inside the loop would add a full-size zero gradient per
        # chunk: quadratic in the chunk count)
        per_chunk = zip(keep.unbind(0), q_eff.unbind(2), weights.unbind(2), trans.unbind(2), writes.unbind(0),
                        local.unbind(2), strict=True)
        for keep_c, q_c, weights_c, trans_c, writes_c, local_c in per_chunk:
            z = z * keep_c[None, None, :, None, None]
            reads_c = q_c[:, :, None] @ z  # [b, h, S, C, V]
            inter.append((weights_c.transpose(-1, -2)[..., None] * reads_c).sum(2))
            z = _carry(z, trans_c) + writes_c[None, None, :, None, None] * local_c[:, :, None]
        o = o + torch.stack(inter, 2)
    o = o.reshape(b, h, nc * CHUNK, dv)[:, :, front: front + t]
    if not want_final:
        return o, None

    i_end = (front + t - 1) % CHUNK
    lev_end = level_of(torch.tensor(i_end, device=dev), offs)  # [C]
    onehot = ((lev_end[:, None] == torch.arange(nl_int, device=dev)[None]) & (offs <= i_end)[:, None]).to(q.dtype)
    final = torch.einsum("bhks,sl,bhsv->bhlkv", zcols[:, :, -1], onehot, vc[:, :, -1])  # levels 0..nl_int-1
    if nj:
        upper = z[:, :, :nj] * reads[-1][None, None, :, None, None]
        final = torch.cat([final[:, :, : CHUNK_LEVELS + 1], upper, final[:, :, CHUNK_LEVELS + 1 + nj:]], 2)
    final = final[:, :, :nl]
    if prior is not None:
        idx_end = prior_level(torch.tensor([p0 + t - 1], device=dev), p0, nl)[0]
        move = (idx_end[:, None] == torch.arange(nl, device=dev)[None]).to(q.dtype)  # [from, to]
        final = final + torch.einsum("lm,bhlkv->bhmkv", move, z[:, :, nj:])
    return o, final


def loglinear_chunk(q, k, v, beta, g, level_scales, scale, initial_state, output_final_state, cu_seqlens, starts,
                    prepare, out_dtype):
    """Run `chunk_levels` over every sequence ([B, T, H, D] inputs, rows or cu_seqlens documents). Rows that share
    a start position run as one batch. Returns (o [B, T, H, V] in out_dtype, final levels [N, H, L, K, V] or None)."""
    b, t, h, _ = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    qf = (q.to(acc) * scale).transpose(1, 2)
    kf, vf = (x.to(acc).transpose(1, 2) for x in (k, v))
    gf = torch.zeros(b, h, t, dtype=acc, device=q.device) if g is None else g.to(acc).transpose(1, 2)
    bf = None if beta is None else beta.to(acc).transpose(1, 2)
    lf = level_scales.to(acc).transpose(1, 2)
    prior = None if initial_state is None else initial_state.levels.to(acc)
    segs = segments(b, t, cu_seqlens)

    def run(rows, s, e, p0, prior_rows):
        sl = (rows, slice(None), slice(s, e))
        return chunk_levels(qf[sl], kf[sl], vf[sl], gf[sl], None if bf is None else bf[sl], lf[sl], p0,
                            prior_rows, output_final_state, prepare)

    if cu_seqlens is None and len(set(starts)) == 1:
        o, final = run(slice(None), 0, t, starts[0], prior if starts[0] > 0 else None)
        o = o.transpose(1, 2)
    else:
        outs, finals = [], []
        for n, (row, s, e) in enumerate(segs):
            prior_n = None if prior is None or starts[n] == 0 else prior[n: n + 1]
            o_n, f_n = run(slice(row, row + 1), s, e, starts[n], prior_n)
            outs.append(o_n)
            finals.append(f_n)
        if cu_seqlens is None:
            o = torch.cat(outs, 0).transpose(1, 2)
        else:
            o = torch.cat(outs, 2).transpose(1, 2)
        final = torch.cat(finals, 0) if output_final_state else None
    return o.to(out_dtype), final
