"""The chunk levels of the log-linear delta rule as a tree of aligned chunk blocks (batched matmuls, no chunk scan).

A drop-in for the level scan's modes 0 and 1 (triton_fwd._delta_level_scan_fwd / triton_bwd._delta_level_scan_bwd):
the same inputs (per chunk row, chunk-major: q_eff, W, Kd [C, K], decay, zcols [K, C], v [C, V], lambda [C, L]; an
initial state's levels and their per-token read weights) and outputs (the reads o [H, rows, C, V], the final
chunk-level states [N, H, nj, K, V] and the prior levels moved to each sequence's end).

Why: the scan walks a sequence's chunks in order, each program carrying all nj level states (K x V each) and moving
them by the chunk's K x K Householder product. That is nj x 2 K^2 V FLOPs per chunk like any exact form, but on only
(V-blocks x sequences x heads) programs, with the states spilling out of registers (33 ms backward at T = 16K).
Here every step is one batched matmul over all chunks of all sequences and heads.

The level state j (bit j of the chunk index c) that chunk c reads is the aligned block of 2^j chunks
[c with bits <= j cleared, c with bits < j cleared) (only the chunks of c's own sequence: a block that starts before
the sequence's first chunk is clipped, one that ends before it is absent), moved to c's start through the blocks of
c's lower set bits. Per block: N (its chunks' writes moved to its end, K x V) and T (the product of its chunks'
transitions M = exp(gl) I - Kd^T W, K x K), built bottom-up: level 0 = one chunk (N = zcols v, T = M), a level-j
block from its two halves, N = T_hi N_lo + N_hi, T = T_hi T_lo. A chunk then reads its blocks nearest first, moving
its queries instead of the states:
    Q = q_eff;  for each set bit j of c, ascending:  o += w_j * (Q N_j);  Q <- Q T_j
and the final chunk-level states of a sequence come the same way from its last chunk: X = M_last; F_j = X N_j;
X <- X T_j. After the last level Q holds each chunk's queries moved to its sequence's first chunk and X the whole
sequence's transition, so an initial state's levels are read as sum_l w_l (Q prior_l) and leave as X prior_l. Every product is exact (the same sums in another order), so fp32 inputs give the scan's values.

Cost: ~2 x rows blocks of (2 K^3 + 2 K^2 V) and nj x rows / 2 reads of (2 C K V + 2 C K^2): the scan's FLOPs, in
batched GEMMs. Memory: the forward keeps N and T of every block (fp32, ~2 x rows x (K V + K^2) per head); the
backward recomputes the query chain level by level. 16-bit inputs multiply in TF32 (as the scan does), fp32 inputs
in full fp32.
"""

import contextlib

import torch

from kernels.loglinear_attn.state import CHUNK_LEVELS
from kernels.loglinear_attn.triton_fwd import CHUNK, LevelLayout


@contextlib.contextmanager
def _matmul_precision(in_dtype: torch.dtype):
    """TF32 tensor-core products for 16-bit inputs (the scan's "tf32" dots), exact fp32 for fp32 inputs."""
    flag = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = in_dtype != torch.float32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = flag


class BlockTree:
    """Host-built index tables of the block tree of a LevelLayout (one per call; every index is on the device).

    nodes[j]: rows (chunk rows) where the level-j blocks end; left[j] / right[j] (j >= 1): their halves' indices
    in level j-1 (left -1 when the lower half lies before the sequence's first chunk).
    reads[j] = (rows, node): the rows with bit j set that read a level-j block, and which one.
    finals[j] = (sequences, node): the sequences whose last chunk has bit j set with a level-j block; last_rows the
    last chunk row of each sequence."""

    def __init__(self, lay: LevelLayout, device):
        c_of, first_of = [], []
        for first, count, p0 in zip(lay.first_rows, lay.chunk_counts, lay.starts):
            c_of.extend(range(p0 // CHUNK, p0 // CHUNK + count))
            first_of.extend([first] * count)
        c = torch.tensor(c_of, dtype=torch.int64)  # each row's chunk index in its sequence (absolute, from p0)
        first = torch.tensor(first_of, dtype=torch.int64)  # each row's sequence's first row
        rows = torch.arange(len(c_of), dtype=torch.int64)
        seq_first = torch.tensor(lay.first_rows, dtype=torch.int64)
        has_last = torch.tensor(lay.chunk_counts, dtype=torch.int64) > 0
        last = torch.where(has_last, seq_first + torch.tensor(lay.chunk_counts) - 1, 0)
        c_last = torch.where(has_last, c[last], 0)
        self.nj = lay.nj
        self.nodes, self.left, self.right, self.reads, self.finals = [], [], [], [], []
        pos_prev = None
        for j in range(self.nj):
            ends = rows[((c + 1) % (1 << j)) == 0]
            pos = torch.full((len(c_of),), -1, dtype=torch.int64)  # row -> index of the level-j block ending there
            pos[ends] = torch.arange(len(ends))
            if j:
                lo = ends - (1 << (j - 1))
                self.left.append(torch.where(lo >= first[ends], pos_prev[lo.clamp(min=0)], -1).to(device))
                self.right.append(pos_prev[ends].to(device))
            else:
                self.left.append(None)
                self.right.append(None)
            self.nodes.append(ends.to(device))
            # bit j of c set: the block ends at the chunk before c with bits < j cleared
            end = rows - (c % (1 << j)) - 1
            on = (((c >> j) & 1) == 1) & (end >= first)
            self.reads.append((rows[on].to(device), pos[end[on]].to(device)))
            end_last = last - (c_last % (1 << j)) - 1
            on_last = has_last & (((c_last >> j) & 1) == 1) & (end_last >= seq_first)
            self.finals.append((torch.arange(len(last))[on_last].to(device), pos[end_last[on_last]].to(device)))
            pos_prev = pos
        self.last_rows = last.to(device)
        self.has_last = has_last.to(device)


def block_tree(lay: LevelLayout, device) -> BlockTree:
    """The BlockTree of lay, built once: layouts are cached (loglinear_attn.triton_fwd.level_layout) and every layer
    of a model sees the same one, so the host tables and their copies to the device are made once per layout."""
    tree = getattr(lay, "block_tree", None)
    if tree is None:
        tree = lay.block_tree = BlockTree(lay, device)
    return tree


def _level_weights(lam: torch.Tensor, j: int) -> torch.Tensor | None:
    """lambda [H, rows, C, L] at level CHUNK_LEVELS + 1 + j (the read weight of bit j), None beyond L."""
    lev = CHUNK_LEVELS + 1 + j
    return lam[..., lev] if lev < lam.shape[-1] else None


def _build(tree: BlockTree, w_wy, kd, decay, zcols, v):
    """N [H, nodes_j, K, V] and T [H, nodes_j, K, K] of every level's blocks."""
    k = w_wy.shape[-1]
    eye = torch.eye(k, device=w_wy.device, dtype=torch.float32)
    ns, ts = [zcols @ v], [decay[..., None, None] * eye - kd.transpose(-1, -2) @ w_wy]
    for j in range(1, tree.nj):
        left, right = tree.left[j], tree.right[j]
        n_hi, t_hi = ns[-1][:, right], ts[-1][:, right]
        has_lo = left >= 0
        lo = left.clamp(min=0)
        on = has_lo[None, :, None, None]
        ns.append(n_hi + torch.where(on, t_hi @ ns[-1][:, lo], 0.0))
        ts.append(torch.where(on, t_hi @ ts[-1][:, lo], t_hi))
    return ns, ts


def _forward(tree: BlockTree, q_eff, lam, ns, ts, nseq, values: bool = True):
    """The reads [H, rows, C, V], the final states [N, H, nj, K, V] (values=False: neither, for the backward) and the
    inputs of every level of the query chain and of the final states' chain."""
    h, rows, c, k = q_eff.shape
    dv = ns[0].shape[-1]
    out = q_eff.new_zeros(h, rows, c, dv)
    q = q_eff.clone()  # updated in place level by level (no autograd here: the Function has its own backward)
    chain = []
    for j in range(tree.nj):
        rsel, node = tree.reads[j]
        qj = q[:, rsel]
        chain.append(qj)
        w = _level_weights(lam, j)
        if values and w is not None and len(rsel):
            out[:, rsel] += w[:, rsel, :, None] * (qj @ ns[j][:, node])
        if len(rsel):
            q.index_copy_(1, rsel, qj @ ts[j][:, node])
    final = q_eff.new_zeros(nseq, h, tree.nj, k, dv)
    x = ts[0][:, tree.last_rows]  # [H, N, K, K]: the last chunk's own transition
    xs = []
    for j in range(tree.nj):
        seqs, node = tree.finals[j]
        xj = x[:, seqs]
        xs.append(xj)
        if values and len(seqs):
            final[seqs, :, j] = (xj @ ns[j][:, node]).transpose(0, 1)
        if len(seqs):
            x.index_copy_(1, seqs, xj @ ts[j][:, node])
    # q: every row's queries moved to its sequence's first chunk (through all its blocks); x: every sequence's
    # transition from its first chunk to its end. The prior levels are read and moved with them.
    return out, final, chain, xs, q, x


def _prior_rows(lay: LevelLayout) -> list[tuple[int, int, int]]:
    """(sequence, first row, row count) of every sequence that continues a prior state (p0 > 0) with chunks."""
    return [(n, first, count) for n, (first, count, p0) in enumerate(zip(lay.first_rows, lay.chunk_counts, lay.starts))
            if p0 > 0 and count > 0]


def _prior_forward(q_full, x_full, wts, prior, lay):
    """Reads of the prior levels, out [H, rows, C, V] += sum_l wts_l (q_full prior_l), and the prior moved to each
    sequence's end, pfin [N, H, L, K, V] = x_full prior (the identity for sequences without chunks)."""
    h, rows, c, k = q_full.shape
    nl, dv = prior.shape[2], prior.shape[-1]
    out = q_full.new_zeros(h, rows, c, dv)
    pfin = prior.clone()
    for n, first, count in _prior_rows(lay):
        qn = q_full[:, first:first + count].reshape(h, count * c, k)
        stacked = prior[n].permute(0, 2, 1, 3).reshape(h, k, nl * dv)  # [H, K, L * V]
        reads = (qn @ stacked).reshape(h, count, c, nl, dv)
        out[:, first:first + count] = (reads * wts[:, first:first + count, :, :, None]).sum(3)
        pfin[n] = x_full[:, n][:, None] @ prior[n]
    return out, pfin


class DeltaLevelNodesFunction(torch.autograd.Function):
    """(q_eff, W, Kd, decay, zcols, v, lambda, prior weights, prior levels) -> (reads [H, rows, C, V], final chunk-level
    states [N, H, nj, K, V], the prior levels moved to each sequence's end [N, H, L, K, V]): DeltaLevelScanFunction's
    modes 0 and 1 (the chunk levels, and the levels of an initial state) as a block tree (module docstring). Without
    a prior (wts, prior None) the third output is an empty tensor."""

    @staticmethod
    def forward(ctx, q_eff, w_wy, kd, decay, zcols, v, lam, wts, prior, lay, in_dtype):
        tree = block_tree(lay, q_eff.device)
        with _matmul_precision(in_dtype):
            ns, ts = _build(tree, w_wy, kd, decay, zcols, v)
            out, final, _, _, q_full, x_full = _forward(tree, q_eff, lam, ns, ts, lay.n)
            pfin = q_eff.new_empty(0)
            if prior is not None:
                prior = prior.float()
                reads, pfin = _prior_forward(q_full, x_full, wts, prior, lay)
                out = out + reads
        ctx.save_for_backward(q_eff, w_wy, kd, zcols, v, lam, wts, prior, *ns, *ts)
        ctx.tree, ctx.lay, ctx.in_dtype, ctx.levels = tree, lay, in_dtype, len(ns)
        ctx.prior_dtype = None if prior is None else prior.dtype
        return out, final, pfin

    @staticmethod
    def backward(ctx, dout, dfinal, dpfin):
        tree, nj, lay = ctx.tree, ctx.tree.nj, ctx.lay
        q_eff, w_wy, kd, zcols, v, lam, wts, prior = ctx.saved_tensors[:8]
        ns, ts = list(ctx.saved_tensors[8:8 + ctx.levels]), list(ctx.saved_tensors[8 + ctx.levels:])
        with _matmul_precision(ctx.in_dtype):
            _, _, chain, xs, q_full, x_full = _forward(tree, q_eff, lam, ns, ts, lay.n, values=False)
            dns = [torch.zeros_like(n) for n in ns]
            dts = [torch.zeros_like(t) for t in ts]
            dlam = torch.zeros_like(lam)
            # the prior's reads and its move to the end: the gradients of q_full and x_full start the chains'
            dq = torch.zeros_like(q_eff)
            dx = torch.zeros_like(ts[0][:, tree.last_rows])
            dwts = dprior = None
            if prior is not None:
                dwts, dprior = _prior_backward(q_full, x_full, wts, prior, dout, dpfin, lay, dq, dx)
            # the reads, last level first: o += w_j (Q_j N_j), Q_{j+1} = Q_j T_j
            if dout is not None:
                for j in reversed(range(nj)):
                    rsel, node = tree.reads[j]
                    if not len(rsel):
                        continue
                    qj, nj_, tj = chain[j], ns[j][:, node], ts[j][:, node]
                    dq_next = dq[:, rsel]
                    dt_part = qj.transpose(-1, -2) @ dq_next
                    dqj = dq_next @ tj.transpose(-1, -2)
                    w = _level_weights(lam, j)
                    if w is not None:
                        do = dout[:, rsel]
                        dlam[:, rsel, :, CHUNK_LEVELS + 1 + j] = ((qj @ nj_) * do).sum(-1)
                        dw = w[:, rsel, :, None] * do
                        dns[j].index_add_(1, node, qj.transpose(-1, -2) @ dw)
                        dqj = dqj + dw @ nj_.transpose(-1, -2)
                    dts[j].index_add_(1, node, dt_part)
                    dq.index_copy_(1, rsel, dqj)
            # the final states: F_j = X_j N_j, X_{j+1} = X_j T_j, X_0 = M_last
            if dfinal is not None or prior is not None:
                for j in reversed(range(nj)):
                    seqs, node = tree.finals[j]
                    if not len(seqs):
                        continue
                    xj, dx_next = xs[j], dx[:, seqs]
                    dts[j].index_add_(1, node, xj.transpose(-1, -2) @ dx_next)
                    dxj = dx_next @ ts[j][:, node].transpose(-1, -2)
                    if dfinal is not None:
                        df = dfinal[seqs, :, j].transpose(0, 1)
                        dns[j].index_add_(1, node, xj.transpose(-1, -2) @ df)
                        dxj = dxj + df @ ns[j][:, node].transpose(-1, -2)
                    dx.index_copy_(1, seqs, dxj)
                dts[0].index_add_(1, tree.last_rows[tree.has_last], dx[:, tree.has_last])
            # the tree, top down: N = T_hi N_lo + N_hi, T = T_hi T_lo
            for j in reversed(range(1, nj)):
                left, right = tree.left[j], tree.right[j]
                has_lo = left >= 0
                lo = left[has_lo]
                dn, dt = dns[j], dts[j]
                dns[j - 1].index_add_(1, right, dn)
                # T_hi: dT itself where there is no lower half, else dN N_lo^T + dT T_lo^T
                dt_hi = dt.clone()
                dt_hi[:, has_lo] = (dn[:, has_lo] @ ns[j - 1][:, lo].transpose(-1, -2)
                                    + dt[:, has_lo] @ ts[j - 1][:, lo].transpose(-1, -2))
                dts[j - 1].index_add_(1, right, dt_hi)
                t_hi = ts[j - 1][:, right[has_lo]]
                dns[j - 1].index_add_(1, lo, t_hi.transpose(-1, -2) @ dn[:, has_lo])
                dts[j - 1].index_add_(1, lo, t_hi.transpose(-1, -2) @ dt[:, has_lo])
            # the leaves: N = zcols v, T = exp(gl) I - Kd^T W
            dn0, dt0 = dns[0], dts[0]
            dzcols = dn0 @ v.transpose(-1, -2)
            dv = zcols.transpose(-1, -2) @ dn0
            ddecay = dt0.diagonal(dim1=-2, dim2=-1).sum(-1)
            dkd = -(w_wy @ dt0.transpose(-1, -2))
            dw_wy = -(kd @ dt0)
        dprior = None if dprior is None else dprior.to(ctx.prior_dtype)
        return dq, dw_wy, dkd, ddecay, dzcols, dv, dlam, dwts, dprior, None, None


def _prior_backward(q_full, x_full, wts, prior, dout, dpfin, lay, dq, dx):
    """Gradients of _prior_forward: returns (dwts, dprior) and adds the gradients of q_full and x_full into dq and
    dx (in place)."""
    h, _, c, k = q_full.shape
    nl, dv = prior.shape[2], prior.shape[-1]
    dwts = torch.zeros_like(wts)
    dprior = torch.zeros_like(prior)
    for n, first, count in _prior_rows(lay):
        stacked = prior[n].permute(0, 2, 1, 3).reshape(h, k, nl * dv)  # [H, K, L * V]
        qn = q_full[:, first:first + count].reshape(h, count * c, k)
        if dout is not None:
            do = dout[:, first:first + count]  # [H, count, C, V]
            reads = (qn @ stacked).reshape(h, count, c, nl, dv)
            dwts[:, first:first + count] = (reads * do[:, :, :, None, :]).sum(-1)
            d_reads = (wts[:, first:first + count, :, :, None] * do[:, :, :, None, :]).reshape(h, count * c, nl * dv)
            dq[:, first:first + count] += (d_reads @ stacked.transpose(-1, -2)).reshape(h, count, c, k)
            dprior[n] += (qn.transpose(-1, -2) @ d_reads).reshape(h, k, nl, dv).permute(0, 2, 1, 3)
        if dpfin is not None and dpfin.numel():
            # pfin[n] = x_full[n] prior[n] (per level)
            dx[:, n] += (dpfin[n] @ prior[n].transpose(-1, -2)).sum(1)
            dprior[n] += x_full[:, n][:, None].transpose(-1, -2) @ dpfin[n]
    if dpfin is not None and dpfin.numel():
        # sequences without chunks (or without a prior: zero levels) pass their prior through unchanged
        moved = {n for n, _, _ in _prior_rows(lay)}
        for n in range(prior.shape[0]):
            if n not in moved:
                dprior[n] += dpfin[n]
    return dwts, dprior
