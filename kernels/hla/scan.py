"""The paper's parallel form of second-order HLA: an associative (semidirect-product) operator over segment
summaries and an exclusive scan over chunks (SPEC §3, "associative-scan form"). A reference that shows the
paper's claim (a parallel scan reproduces the serial activations exactly) for the masked operator; the
production path is kernels.hla.compose.

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


def identity_like(x: Summary) -> Summary:
    """The neutral summary (the empty segment) with x's shapes."""
    return Summary(*(None if f is None else (torch.ones_like(f) if name == "rho" else torch.zeros_like(f))
                     for name, f in zip(Summary._fields, x, strict=True)))


def token_summaries(q, k, v, g=None, scale: float = 1.0) -> Summary:
    """One summary per token: q, k [..., K], v [..., V], g [...] or None -> Summary with leading dims [...]."""
    q = q * scale
    zeros_kv = torch.zeros(*q.shape, v.shape[-1], dtype=q.dtype, device=q.device)
    return Summary(k[..., :, None] * k[..., None, :], q[..., :, None] * v[..., None, :], q, zeros_kv,
                   torch.zeros_like(q), None if g is None else g.exp())


def _index(x: Summary, idx) -> Summary:
    return Summary(*(None if f is None else f[idx] for f in x))


def blelloch_exclusive_scan(items: list[Summary]) -> list[Summary]:
    """Work-efficient exclusive scan (up-sweep, then down-sweep) of a list of summaries: out[c] is the summary
    of items[0..c-1] (the identity for c = 0). The down-sweep regroups the products, which is why it equals
    the serial fold only for an associative operator."""
    n = len(items)
    size = 1 << max(n - 1, 0).bit_length()
    tree = list(items) + [identity_like(items[0])] * (size - n)
    step = 1
    while step < size:
        for i in range(2 * step - 1, size, 2 * step):
            tree[i] = combine(tree[i - step], tree[i])
        step *= 2
    tree[size - 1] = identity_like(items[0])
    while step > 1:
        step //= 2
        for i in range(2 * step - 1, size, 2 * step):
            left = tree[i - step]
            tree[i - step] = tree[i]
            tree[i] = combine(tree[i], left)
    return tree[:n]


def inclusive_scan(x: Summary, dim: int) -> Summary:
    """Hillis-Steele inclusive scan along `dim` (a leading dim of every field): log2(n) rounds of
    x_i <- x_{i - d} (+) x_i."""
    n = x.S.shape[dim]
    d = 1
    while d < n:
        head = Summary(*(None if f is None else f.narrow(dim, 0, d) for f in x))
        prev = Summary(*(None if f is None else f.narrow(dim, 0, n - d) for f in x))
        cur = Summary(*(None if f is None else f.narrow(dim, d, n - d) for f in x))
        x = Summary(*(None if a is None else torch.cat([a, b], dim)
                      for a, b in zip(head, combine(prev, cur), strict=True)))
        d *= 2
    return x


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
    within = inclusive_scan(tokens, dim=2)
    prefixes = blelloch_exclusive_scan([_index(within, (slice(None), c, -1)) for c in range(nc)])
    stacked = Summary(*(None if fs[0] is None else torch.stack(fs, 1)[:, :, None]
                        for fs in zip(*prefixes, strict=True)))
    incl = combine(stacked, within)
    qs = qc * scale
    o = torch.einsum("bnchk,bnchkv->bnchv", qs, incl.S @ incl.C - incl.G)
    den = torch.einsum("bnchk,bnchk->bnch", qs, (incl.S @ incl.m[..., None])[..., 0] - incl.h)
    return o.reshape(b, nc * chunk, h, -1)[:, :t], den.reshape(b, nc * chunk, h)[:, :t]
