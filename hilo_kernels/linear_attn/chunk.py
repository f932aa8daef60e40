"""Chunked PyTorch linear attention: exact, differentiable through autograd, the CPU path.

Per chunk of C = 64 tokens (chunks never cross a document boundary), with gc the in-chunk inclusive
cumsum of g and gl its last value, S the state entering the chunk:
    o_i   = scale * ( exp(gc_i) q_i S  +  sum_{j <= i} exp(gc_i - gc_j) (q_i . k_j) v_j )
    S_out = exp(gl) S + sum_j exp(gl - gc_j) k_j v_j^T
The intra-chunk terms of all chunks are computed at once; the state pass runs chunk by chunk (without cu_seqlens,
the rows' j-th chunks in one step). The chunk
table comes from hilo_kernels.common.varlen on the tensors' device, so no host synchronisation happens.
"""

import torch

from hilo_kernels.common.varlen import chunk_table, sequence_bounds

CHUNK = 64


def linear_attn_chunk(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, chunk: int = CHUNK):
    """Same contract as linear_attn_naive: returns (o in q's dtype, final_state fp32 [N, H, K, V] or None)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    dt = torch.promote_types(q.dtype, torch.float32)
    dev = q.device
    total = b * t
    bounds = sequence_bounds(cu_seqlens, b, t, dev)
    n = bounds.numel() - 1
    table, offsets = chunk_table(bounds, total, chunk)
    table = table.long()
    offsets = offsets.long()
    start, end, seq = table[:, 0], table[:, 1], table[:, 2]
    nc = table.shape[0]

    idx = start[:, None] + torch.arange(chunk, device=dev)
    valid = idx < end[:, None]
    gather = torch.where(valid, idx, torch.zeros_like(idx))
    vmask = valid[..., None, None].to(dt)
    qc = q.reshape(total, h, dk).to(dt)[gather] * vmask
    kc = k.reshape(total, h, dk).to(dt)[gather] * vmask
    vc = v.reshape(total, h, dv).to(dt)[gather] * vmask
    if g is None:
        gc = torch.zeros(nc, chunk, h, dtype=dt, device=dev)
    else:
        gc = torch.cumsum(g.reshape(total, h).to(dt)[gather] * valid[..., None].to(dt), dim=1)
    gl = gc[:, -1]

    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=dev).tril()
    diff = gc.permute(0, 2, 1)[:, :, :, None] - gc.permute(0, 2, 1)[:, :, None, :]
    decay = torch.where(causal, diff, torch.full_like(diff, float("-inf"))).exp()
    scores = torch.einsum("nihk,njhk->nhij", qc, kc) * decay
    o_intra = torch.einsum("nhij,njhv->nihv", scores, vc)

    kdec = kc * (gl[:, None] - gc).exp()[..., None]
    local = torch.einsum("njhk,njhv->nhkv", kdec, vc)
    h0 = (torch.zeros(n, h, dk, dv, dtype=dt, device=dev) if initial_state is None
          else initial_state.to(dt))
    decay_last = gl.exp()[:, :, None, None]
    if cu_seqlens is None and t > 0:
        # b rows of cps chunks each, in row order: the state pass steps through a row's chunks for all rows at once
        cps = -(-t // chunk)
        real = n * cps
        state, states_in = h0, []
        for local_j, decay_j in zip(local[:real].reshape(n, cps, h, dk, dv).unbind(1),
                                    decay_last[:real].reshape(n, cps, h, 1, 1).unbind(1), strict=True):
            states_in.append(state)
            state = decay_j * state + local_j
        s_in = torch.stack(states_in, 1).reshape(real, h, dk, dv)
        s_in = torch.cat([s_in, s_in.new_zeros(nc - real, h, dk, dv)])  # the table's empty tail rows
        final = state
    else:
        s_in, final = _packed_states(local, decay_last, h0, seq, offsets, nc)
    o_inter = torch.einsum("nihk,nhkv->nihv", qc * gc.exp()[..., None], s_in)
    oc = scale * (o_intra + o_inter)

    scatter = torch.where(valid, idx, torch.full_like(idx, total)).reshape(-1)
    o = torch.zeros(total + 1, h, dv, dtype=dt, device=dev).index_add(0, scatter, oc.reshape(-1, h, dv))
    o = o[:total].reshape(b, t, h, dv).to(q.dtype)
    if not output_final_state:
        return o, None
    return o, final.to(torch.float32 if dt == torch.float32 else dt)


def _packed_states(local, decay_last, h0, seq, offsets, nc):
    """(states entering each chunk [nc, H, K, V], final states [N, H, K, V]) of documents packed one after another in
    the chunk table: one step per chunk of the table, a document's first chunk starting from its initial state."""
    first = (torch.arange(nc, device=local.device) == offsets[seq]).unbind(0)
    # per-chunk views taken once by unbind: indexing the stacked tensors inside the loop would make autograd add a
    # full-size zero gradient per chunk, quadratic in the chunk count (docs/performance.md)
    local_c, decay_c, h0_c = local.unbind(0), decay_last.unbind(0), h0[seq].unbind(0)
    states_in, states_out = [], []
    prev = h0_c[0]
    for c in range(nc):
        s_in = torch.where(first[c], h0_c[c], prev)
        prev = decay_c[c] * s_in + local_c[c]
        states_in.append(s_in)
        states_out.append(prev)
    s_out = torch.stack(states_out, 0)
    last = (offsets[1:] - 1).clamp(min=0)
    has_chunks = (offsets[1:] > offsets[:-1])[:, None, None, None]
    return torch.stack(states_in, 0), torch.where(has_chunks, s_out[last], h0)
