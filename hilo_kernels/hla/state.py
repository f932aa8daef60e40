"""Recurrent states of the HLA family, their validation, the decay conventions and the normalization helpers.

States (per sequence n and head h; b_t = prod_{r <= t} exp(g_r) in the sequence; `Vs` is V, or V + 1 with
normalize=True, whose last column then carries the denominator, the same operator applied to a value of ones):

    HLA2State(S [N, H, K, K], F [N, H, K, Vs])     S = sum_i (b_t/b_i)^p_in  k_i k_i^T
                                                   F = sum_j (b_t/b_j)^p_out (S_j^T q_j) v_j^T
    AHLAState(P [N, H, K, Vs], E [N, H, K, Vs])    P = sum_j (b_t/b_j) k_j v_j^T
                                                   E = sum_i (b_t/b_i) k_i (P_i^T q_i)^T
    HLA3State(S [N, H, K, K], P [N, H, K, Vs], F [N, H, K, Vs])
                                                   S = sum_i (b_t/b_i)^2 k_i k_i^T,  P as for ahla,
                                                   F = sum_j (b_t/b_j) (S_j^T q_j)(P_j^T q_j)^T

(q already multiplied by `scale`.) Each field is the state of one linear_attn pass of the composition, so the
fields are fp32 (float64 for float64 inputs) and continue exactly: forward(a + b) == forward(b,
initial_state=forward(a).final_state). (p_in, p_out) = (2, 1) for hla2 decay "d1", (1, 2) for "d2".
"""

from typing import NamedTuple

import torch

DECAYS = ("d1", "d2")


class HLA2State(NamedTuple):
    """Second-order HLA state: S the key moment (inner pass), F the output accumulator (outer pass)."""

    S: torch.Tensor
    F: torch.Tensor


class AHLAState(NamedTuple):
    """Asymmetric HLA state: P the key-value moment (inner pass), E the output accumulator (outer pass)."""

    P: torch.Tensor
    E: torch.Tensor


class HLA3State(NamedTuple):
    """Third-order HLA state: S the key moment, P the key-value moment, F the output accumulator."""

    S: torch.Tensor
    P: torch.Tensor
    F: torch.Tensor


STATE_TYPES = {"hla2": HLA2State, "ahla": AHLAState, "hla3": HLA3State}
# Which fields have K columns (the key moment) and which carry the value columns.
_KEY_FIELDS = {"S"}


def decay_powers(op: str, decay: str) -> tuple[int, int]:
    """(p_in, p_out): the multiples of g used by the inner and outer passes (hla3: p_in for S, P uses 1)."""
    if decay not in DECAYS:
        raise ValueError(f"{op}: decay must be one of {DECAYS}, got {decay!r}")
    if op != "hla2" and decay != "d1":
        raise ValueError(f"{op}: only decay='d1' is defined; 'd2' exists for hla2 only")
    if op == "ahla":
        return 1, 1
    return (2, 1) if decay == "d1" else (1, 2)


def powered(g, power):
    """A pass's log decay: power * g (g itself for power 1; None without decay)."""
    return None if g is None else (g if power == 1 else power * g)


def state_shapes(op: str, n: int, h: int, dk: int, dvs: int) -> dict[str, tuple[int, ...]]:
    """Expected shape of every field of `op`'s state."""
    return {f: (n, h, dk, dk if f in _KEY_FIELDS else dvs) for f in STATE_TYPES[op]._fields}


def zero_state(op: str, n: int, h: int, dk: int, dvs: int, dtype=torch.float32, device=None):
    """The state of N sequences that have consumed no token."""
    shapes = state_shapes(op, n, h, dk, dvs)
    return STATE_TYPES[op](*(torch.zeros(s, dtype=dtype, device=device) for s in shapes.values()))


def check_state(op: str, state, n: int, h: int, dk: int, dvs: int, device, normalize: bool) -> None:
    """Raise a readable error unless `state` is op's state type with fp32/fp64 fields of the right shapes."""
    cls = STATE_TYPES[op]
    if not isinstance(state, cls):
        raise TypeError(f"{op}: initial_state must be a hilo_kernels.hla.{cls.__name__} or None, got "
                        f"{type(state).__name__}")
    for (name, shape), x in zip(state_shapes(op, n, h, dk, dvs).items(), state, strict=True):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: initial_state.{name} must be a torch.Tensor")
        if tuple(x.shape) != shape:
            extra = " (normalize=True adds one value column for the denominator)" if normalize else ""
            raise ValueError(f"{op}: initial_state.{name} must have shape {list(shape)}{extra}, got "
                             f"{list(x.shape)}")
        if x.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{op}: initial_state.{name} must be float32, got {x.dtype}")
        if x.device != device:
            raise ValueError(f"{op}: initial_state.{name} must be on {device} like q, got {x.device}")


def with_ones(v: torch.Tensor) -> torch.Tensor:
    """Append a column of ones to the values (the denominator rides along in every pass: all are linear in v)."""
    return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)


def signed_clamp(x: torch.Tensor, eps: float) -> torch.Tensor:
    """sign(x) * max(|x|, eps), with sign(0) taken as +1 so the result is never zero."""
    return torch.where(x >= 0, x.clamp(min=eps), x.clamp(max=-eps))


def split_normalized(o: torch.Tensor, eps: float) -> torch.Tensor:
    """o [..., V + 1] with the denominator last -> numerator / signed_clamp(denominator)."""
    return o[..., :-1] / signed_clamp(o[..., -1:], eps)
