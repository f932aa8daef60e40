"""Pieces that several mixers share around the kernels: the q/k L2 normalization, value-column blocks, and running
an HLA operator (hla2, ahla, hla3) with its cache-slot state and FLOP count."""

import torch

from hilo_kernels import ahla, hla2, hla3
from hilo_kernels.hla import AHLAState, HLA2State, HLA3State, hla_step


def value_blocks(dv: int, width: int) -> list[tuple[int, int]]:
    """(lo, hi) column ranges of at most `width` columns covering a value head of dv columns."""
    return [(lo, min(lo + width, dv)) for lo in range(0, dv, width)]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32, returned in x's dtype.

    vector_norm with an fp32 result and the mixed-dtype product keep only x and the per-row norm for the backward
    (no fp32 copy of x).
    """
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.promote_types(x.dtype, torch.float32))
    return (x * torch.rsqrt(norm.square() + eps)).to(x.dtype)


OPERATORS = {"hla2": hla2, "ahla": ahla, "hla3": hla3}
STATES = {"hla2": HLA2State, "ahla": AHLAState, "hla3": HLA3State}
# Chunk length of linear_attn's chunked algorithm, which every pass of the compositions runs (flops_per_token).
PASS_CHUNK = 64


def read_operator_state(operator: str, slot: dict | None):
    """operator's state (hilo_kernels.hla.state) from the fields of a cache slot, or None when it holds none yet."""
    fields = STATES[operator]._fields
    if slot is None or fields[0] not in slot:
        return None
    return STATES[operator](*(slot[f] for f in fields))


def write_operator_state(slot: dict, state) -> None:
    """Store an HLA state in a cache slot, field by field under the state's names."""
    slot.update(zip(state._fields, state, strict=True))


def run_operator(operator, q, k, v, g, state, output_final_state, cu_seqlens, *, decay="d1", normalize=False,
                 backend=None):
    """operator (hla2, ahla, hla3) at scale 1 on q, k [B, T, H, K], v [B, T, H, V], g [B, T, H] fp32 or None,
    continuing state (None: from zeros); returns (o [B, T, H, V], the final state or None).

    A single token that continues a cached state (T == 1, output_final_state, no cu_seqlens) takes the recurrent
    step hilo_kernels.hla.hla_step; anything else runs the chunked operator (cu_seqlens restarts it per document).
    """
    kwargs = {"decay": decay, "normalize": normalize, "scale": 1.0}
    if output_final_state and q.shape[1] == 1 and cu_seqlens is None:
        o, state = hla_step(operator, q[:, 0], k[:, 0], v[:, 0], g=None if g is None else g[:, 0], state=state,
                            **kwargs)
        return o.unsqueeze(1), state
    return OPERATORS[operator](q, k, v, g=g, initial_state=state, output_final_state=output_final_state,
                               cu_seqlens=cu_seqlens, backend=backend, **kwargs)


def operator_pass_flops(operator: str, chunk: int, dk: int, dv: int) -> int:
    """Forward FLOPs per head and token of operator's linear_attn passes over chunks of `chunk` tokens.

    Each pass LA(Q, K, W) with K key columns and W value columns costs what the chunked linear_attn costs (as in
    the Mamba-2 mixer): 2C(K + W) + 4KW. hla2 runs LA(Q, K, K) (W = K) and LA(Q, K~, V) (W = V); ahla LA(Q, K, V)
    and LA(Q, K, V~) (W = V twice); hla3 LA(Q, K, K), LA(Q, K, V) and LA(Q, K~, V~).
    """
    widths = {"hla2": (dk, dv), "ahla": (dv, dv), "hla3": (dk, dv, dv)}[operator]
    return sum(2 * chunk * (dk + w) + 4 * dk * w for w in widths)
