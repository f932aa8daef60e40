"""The paper's parallel form of second-order HLA: an associative (semidirect-product) operator over segment
summaries and an exclusive scan over chunks (the associative-scan form of docs/kernels.md). A reference that shows the
paper's claim (a parallel scan reproduces the serial activations exactly) for the masked operator; the
production path is hilo_kernels.hla.compose.

Summary of a segment (per head; q already multiplied by `scale`; rho = product of exp(g) over the segment,
None for the undecayed operator):
    S = sum_i k_i k_i^T,   C = sum_j q_j v_j^T,   m = sum_j q_j,
    G = sum_{j < i} k_i k_i^T q_j v_j^T,   h = sum_{j < i} k_i k_i^T q_j        (each term decayed to the end)
Segment A then segment B:
    undecayed  (S_A+S_B, C_A+C_B, m_A+m_B, G_A+G_B+S_B C_A, h_A+h_B+S_B m_A)
    "d2"       (r S_A+S_B, r C_A+C_B, r m_A+m_B, r^2 G_A+G_B+r S_B C_A, r^2 h_A+h_B+r S_B m_A, rho_A r),  r = rho_B
A token is (k k^T, q v^T, q, 0, 0; rho = exp(g_t)); on the inclusive prefix of t,
    o_t = q_t^T (S C - G)      (the masked hla2, decay "d2" when decayed),
    den_t = q_t^T (S m - h)    (the same operator on a value of ones: normalize's denominator).
The decayed rule is the "decay every summary" one: its serial form is G_t = a^2 G_{t-1} + a k_t (k_t^T C_{t-1}).

AHLA (ahla_scan) uses summaries (R, P, E; rho) with R = sum k q^T, P = sum k v^T, E = sum_i k_i q_i^T P_i and
    (R_A+R_B, r P_A+P_B, r E_A+E_B+r R_B P_A, rho_A r),  r = rho_B:  R is not decayed (docs/kernels.md),
a token is (k q^T, k v^T, (q.k) k v^T; exp(g_t)) and o_t = q_t^T E on the inclusive prefix of t (the masked ahla).
"""

from typing import NamedTuple

import torch


class Summary(NamedTuple):
    """Segment summary: S [..., K, K], C [..., K, V], m [..., K], G [..., K, V], h [..., K], rho [...] or None."""

    S: torch.Tensor
    C: torch.Tensor
    m: torch.Tensor
    G: torch.Tensor
    h: torch.Tensor
    rho: torch.Tensor | None


def combine(a: Summary, b: Summary) -> Summary:
    """The summary of segment a followed by segment b (associative, not commutative)."""
    if b.rho is None:
        return Summary(a.S + b.S, a.C + b.C, a.m + b.m, a.G + b.G + b.S @ a.C,
                       a.h + b.h + (b.S @ a.m[..., None])[..., 0], None)
    rv = b.rho[..., None]  # broadcast over a vector field
    rm = rv[..., None]  # over a matrix field
    return Summary(rm * a.S + b.S, rm * a.C + b.C, rv * a.m + b.m,
                   rm * rm * a.G + b.G + rm * (b.S @ a.C),
                   rv * rv * a.h + b.h + rv * (b.S @ a.m[..., None])[..., 0], a.rho * b.rho)


def identity_like(x):
    """The neutral summary (the empty segment) with x's type and shapes (a Summary or an AHLASummary)."""
    return type(x)(*(None if f is None else (torch.ones_like(f) if name == "rho" else torch.zeros_like(f))
                     for name, f in zip(x._fields, x, strict=True)))


def token_summaries(q, k, v, g=None, scale: float = 1.0) -> Summary:
    """One summary per token: q, k [..., K], v [..., V], g [...] or None -> Summary with leading dims [...]."""
    q = q * scale
    zeros_kv = torch.zeros(*q.shape, v.shape[-1], dtype=q.dtype, device=q.device)
    return Summary(k[..., :, None] * k[..., None, :], q[..., :, None] * v[..., None, :], q, zeros_kv,
                   torch.zeros_like(q), None if g is None else g.exp())


def _index(x, idx):
    return type(x)(*(None if f is None else f[idx] for f in x))


def blelloch_exclusive_scan(items: list, op=combine) -> list:
    """Work-efficient exclusive scan (up-sweep, then down-sweep) of a list of summaries under `op` (combine, or
    ahla_combine for AHLA summaries): out[c] is the summary of items[0..c-1] (the identity for c = 0). The
    down-sweep regroups the products, which is why it equals the serial fold only for an associative operator."""
    n = len(items)
    size = 1 << max(n - 1, 0).bit_length()
    tree = list(items) + [identity_like(items[0])] * (size - n)
    step = 1
    while step < size:
        for i in range(2 * step - 1, size, 2 * step):
            tree[i] = op(tree[i - step], tree[i])
        step *= 2
    tree[size - 1] = identity_like(items[0])
    while step > 1:
        step //= 2
        for i in range(2 * step - 1, size, 2 * step):
            left = tree[i - step]
            tree[i - step] = tree[i]
            tree[i] = op(tree[i], left)
    return tree[:n]


def inclusive_scan(x, dim: int, op=combine):
    """Hillis-Steele inclusive scan along `dim` (a leading dim of every field) under `op`: log2(n) rounds of
    x_i <- x_{i - d} (+) x_i."""
    n = x[0].shape[dim]
    kind = type(x)
    d = 1
    while d < n:
        head = kind(*(None if f is None else f.narrow(dim, 0, d) for f in x))
        prev = kind(*(None if f is None else f.narrow(dim, 0, n - d) for f in x))
        cur = kind(*(None if f is None else f.narrow(dim, d, n - d) for f in x))
        x = kind(*(None if a is None else torch.cat([a, b], dim) for a, b in zip(head, op(prev, cur), strict=True)))
        d *= 2
    return x


def _chunked_inclusive_prefixes(tokens, nc: int, op):
    """Inclusive prefix summary of every token, for token summaries laid out [B, NC, C, ...]: each chunk is
    scanned inclusively (Hillis-Steele), the chunk totals exclusively (Blelloch), and the inclusive prefix of a
    token is (exclusive prefix of its chunk) (+) (in-chunk inclusive prefix of the token)."""
    within = inclusive_scan(tokens, dim=2, op=op)
    prefixes = blelloch_exclusive_scan([_index(within, (slice(None), c, -1)) for c in range(nc)], op)
    stacked = type(tokens)(*(None if fs[0] is None else torch.stack(fs, 1)[:, :, None]
                             for fs in zip(*prefixes, strict=True)))
    return op(stacked, within)


def hla2_scan(q, k, v, g=None, *, scale: float = 1.0, chunk: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked hla2 (undecayed, or decay "d2" when g is given) through the associative scan.

    q, k [B, T, H, K], v [B, T, H, V], g [B, T, H] or None. Tokens are cut into chunks of `chunk`; each chunk's
    tokens are scanned inclusively (Hillis-Steele), the chunk totals are scanned exclusively (Blelloch), and the
    inclusive prefix of token t is (exclusive prefix of its chunk) (+) (in-chunk inclusive prefix of t).
    Returns (o [B, T, H, V], den [B, T, H]) in float32 (float64 for float64 inputs).
    """
    b, t, h = q.shape[:3]
    dt = torch.promote_types(q.dtype, torch.float32)
    nc = -(-t // chunk)
    pad = nc * chunk - t

    def blocks(x):
        x = torch.nn.functional.pad(x.to(dt), (0, 0) * (x.ndim - 3) + (0, 0, 0, pad))
        return x.reshape(b, nc, chunk, *x.shape[2:])  # zero tokens (g = 0) are the identity

    qc = blocks(q)
    tokens = token_summaries(qc, blocks(k), blocks(v), None if g is None else blocks(g), scale)
    incl = _chunked_inclusive_prefixes(tokens, nc, combine)
    qs = qc * scale
    o = torch.einsum("bnchk,bnchkv->bnchv", qs, incl.S @ incl.C - incl.G)
    den = torch.einsum("bnchk,bnchk->bnch", qs, (incl.S @ incl.m[..., None])[..., 0] - incl.h)
    return o.reshape(b, nc * chunk, h, -1)[:, :t], den.reshape(b, nc * chunk, h)[:, :t]


class AHLASummary(NamedTuple):
    """AHLA segment summary (per head, q already multiplied by `scale`, each term decayed to the segment's end):
        R = sum_i k_i q_i^T (NOT decayed),   P = sum_j k_j v_j^T,   E = sum_i k_i q_i^T P_i (P_i: in-segment prefix),
    R [..., K, K], P and E [..., K, V], rho [...] (product of exp(g) over the segment) or None without decay."""

    R: torch.Tensor
    P: torch.Tensor
    E: torch.Tensor
    rho: torch.Tensor | None


def ahla_combine(a: AHLASummary, b: AHLASummary) -> AHLASummary:
    """AHLA's semidirect product, segment a then segment b (associative), r = rho_B:
        (R_A + R_B,  r P_A + P_B,  r E_A + E_B + r R_B P_A,  rho_A r).
    For a token i of B, P_i = (b_i / b_endA) P_A + (its in-B prefix); E weighs it by b_endB / b_i, so the cross
    term is r sum_{i in B} k_i q_i^T P_A: R must not decay (the paper decays it)."""
    if b.rho is None:
        return AHLASummary(a.R + b.R, a.P + b.P, a.E + b.E + b.R @ a.P, None)
    r = b.rho[..., None, None]
    return AHLASummary(a.R + b.R, r * a.P + b.P, r * a.E + b.E + r * (b.R @ a.P), a.rho * b.rho)


def ahla_token_summaries(q, k, v, g=None, scale: float = 1.0) -> AHLASummary:
    """One AHLA summary per token: (k q^T, k v^T, (q.k) k v^T; exp(g))."""
    q = q * scale
    kv = k[..., :, None] * v[..., None, :]
    return AHLASummary(k[..., :, None] * q[..., None, :], kv, (q * k).sum(-1)[..., None, None] * kv,
                       None if g is None else g.exp())


def ahla_scan(q, k, v, g=None, *, scale: float = 1.0, chunk: int = 8, op=ahla_combine) -> torch.Tensor:
    """Masked AHLA (o_t = sum_{j <= i <= t} (b_t/b_j)(q_t.k_i)(q_i.k_j) v_j) through the associative scan:
    o_t = q_t^T E on the inclusive prefix of t, computed as in hla2_scan (chunks of `chunk` tokens, Hillis-Steele
    inside, Blelloch over chunk totals). q, k [B, T, H, K], v [B, T, H, V], g [B, T, H] or None; `op` is the
    segment operator (tests pass the paper's to show it is wrong). The denominator of normalize=True is the
    same scan with v = ones. Returns o [B, T, H, V] in float32 (float64 for float64 inputs)."""
    b, t, h = q.shape[:3]
    dt = torch.promote_types(q.dtype, torch.float32)
    nc = -(-t // chunk)
    pad = nc * chunk - t

    def blocks(x):
        x = torch.nn.functional.pad(x.to(dt), (0, 0) * (x.ndim - 3) + (0, 0, 0, pad))
        return x.reshape(b, nc, chunk, *x.shape[2:])  # zero tokens (g = 0) are the identity

    qc = blocks(q)
    incl = _chunked_inclusive_prefixes(
        ahla_token_summaries(qc, blocks(k), blocks(v), None if g is None else blocks(g), scale), nc, op)
    o = torch.einsum("bnchk,bnchkv->bnchv", qc * scale, incl.E)
    return o.reshape(b, nc * chunk, h, -1)[:, :t]
