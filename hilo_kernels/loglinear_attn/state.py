"""The per-level state of the log-linear operators, Fenwick level arithmetic and input validation (docs/kernels.md).

Level of source position s seen from query position t (positions count from 0 in each document):
    l(t, s) = bit_length(t XOR s)            (0 for s == t)
Level l >= 1 holds the 2^(l-1) tokens s that share t's bits above l-1 and have bit l-1 clear while t has it set.

State (`LogLinearState`): after a document has consumed `tokens` = n >= 1 tokens (last position p = n - 1),
`levels[:, :, l]` is the K x V state of bucket l as seen from p:
    levels[l] = sum_{s <= p, l(p, s) = l} P_{p<-s} k_s v_s^T        (delta rule: beta_s k_s v_s^T)
with P_{p<-s} the transition from s to p (exp(G_p - G_s) for linear attention, the product of
exp(g_r)(I - beta_r k_r k_r^T) for the delta rule). These are exactly the states of the binary-carry recurrence
after step p. For n == 0 the levels must be zero and are not read (they get no gradient). Continuing from such a state, query t >= n sees prior level l
through level max(l, bit_length(t XOR (n - 1))), which is what every backend computes.
"""

import itertools
from typing import NamedTuple

import torch

CHUNK_LEVELS = 6  # log2 of the chunk length 64: levels 0..6 live inside one chunk


class LogLinearState(NamedTuple):
    """Per-level recurrent state of a log-linear operator.

    levels: fp32 [N, H, L, K, V], levels[:, :, l] the bucket-l state as seen from the last consumed position.
    tokens: int64 [N], how many tokens each sequence has consumed (the next token's position).
    """

    levels: torch.Tensor
    tokens: torch.Tensor

    @classmethod
    def empty(cls, n: int, h: int, dk: int, dv: int, num_levels: int = 1, device=None) -> "LogLinearState":
        """The state of N sequences that have consumed no token: zero levels, tokens 0."""
        return cls(torch.zeros(n, h, num_levels, dk, dv, dtype=torch.float32, device=device),
                   torch.zeros(n, dtype=torch.int64, device=device))

    def grow(self, num_levels: int) -> "LogLinearState":
        """The same state with zero levels appended up to `num_levels` (no-op if it already has as many).
        Decoding needs bit_length(position) + 1 levels, so a cache grows its state at powers of two."""
        have = self.levels.shape[2]
        if num_levels <= have:
            return self
        pad = self.levels.new_zeros(*self.levels.shape[:2], num_levels - have, *self.levels.shape[3:])
        return LogLinearState(torch.cat([self.levels, pad], 2), self.tokens)


def num_levels(length: int) -> int:
    """Levels needed for positions 0..length-1: bit_length(length - 1) + 1 (1 for length <= 1)."""
    return max(length - 1, 0).bit_length() + 1


def bit_length(x: torch.Tensor) -> torch.Tensor:
    """Elementwise bit_length of a non-negative integer tensor (exact, no floating point)."""
    x = x.to(torch.int64)
    out = torch.zeros_like(x)
    for shift in (32, 16, 8, 4, 2, 1):  # binary search on the highest set bit
        high = (x >> shift) != 0
        out = out + high * shift
        x = torch.where(high, x >> shift, x)
    return out + (x != 0)


def level_of(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """l(t, s) = bit_length(t XOR s), broadcast over t and s (int64 positions)."""
    return bit_length(torch.bitwise_xor(t.to(torch.int64), s.to(torch.int64)))


def prior_level(t: torch.Tensor, tokens: int, num: int) -> torch.Tensor:
    """[len(t), num] index of the level through which query t >= tokens sees prior level l < num of a state that
    consumed `tokens` >= 1 tokens: max(l, bit_length(t XOR (tokens - 1)))."""
    d = level_of(t, torch.full_like(t, tokens - 1))
    lv = torch.arange(num, device=t.device, dtype=torch.int64)
    return torch.maximum(lv[None, :], d[:, None])


def segments(b: int, t: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(row, start, end) of every sequence: the B rows, or the documents of cu_seqlens (B == 1)."""
    if cu_seqlens is None:
        return [(i, 0, t) for i in range(b)]
    bounds = [int(x) for x in cu_seqlens.tolist()]
    return [(0, s, e) for s, e in itertools.pairwise(bounds)]


def check_loglinear_inputs(op: str, q: torch.Tensor, v: torch.Tensor, level_scales, initial_state, n: int,
                           cu_seqlens: torch.Tensor | None) -> list[int]:
    """Validate level_scales [B, T, H, L] and initial_state (a LogLinearState with levels [N, H, L, K, V] fp32 and
    tokens [N] int64), and that L covers every position: L >= bit_length(tokens + len - 1) + 1 per sequence.
    Returns the start position (tokens already consumed) of each sequence. Runs on the host (reads cu_seqlens and
    initial_state.tokens)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    if not isinstance(level_scales, torch.Tensor):
        raise TypeError(f"{op}: level_scales must be a torch.Tensor [B, T, H, L], got {type(level_scales).__name__}")
    if level_scales.ndim != 4 or tuple(level_scales.shape[:3]) != (b, t, h) or level_scales.shape[3] < 1:
        raise ValueError(f"{op}: level_scales must have shape [B={b}, T={t}, H={h}, L>=1], got "
                         f"{tuple(level_scales.shape)}")
    if not level_scales.is_floating_point():
        raise TypeError(f"{op}: level_scales must be a floating tensor, got {level_scales.dtype}")
    if level_scales.device != q.device:
        raise ValueError(f"{op}: level_scales must be on {q.device} like q, got {level_scales.device}")
    nl = level_scales.shape[3]
    if initial_state is None:
        starts = [0] * n
    else:
        if not isinstance(initial_state, LogLinearState):
            raise TypeError(f"{op}: initial_state must be a LogLinearState(levels [N, H, L, K, V], tokens [N]) or "
                            f"None, got {type(initial_state).__name__}")
        lv, tok = initial_state
        if not isinstance(lv, torch.Tensor) or tuple(lv.shape) != (n, h, nl, dk, dv):
            raise ValueError(f"{op}: initial_state.levels must have shape [N={n}, H={h}, L={nl}, K={dk}, V={dv}], "
                             f"got {tuple(getattr(lv, 'shape', ()))}")
        if lv.dtype not in (torch.float32, torch.float64) or lv.device != q.device:
            raise TypeError(f"{op}: initial_state.levels must be float32 on {q.device}, got {lv.dtype} on "
                            f"{lv.device}")
        if not isinstance(tok, torch.Tensor) or tuple(tok.shape) != (n,) or tok.is_floating_point():
            raise ValueError(f"{op}: initial_state.tokens must be an integer tensor [N={n}], got "
                             f"{getattr(tok, 'dtype', type(tok).__name__)} {tuple(getattr(tok, 'shape', ()))}")
        starts = [int(x) for x in tok.tolist()]
        if any(x < 0 for x in starts):
            raise ValueError(f"{op}: initial_state.tokens must be >= 0, got {starts}")
        fresh = torch.tensor([x == 0 for x in starts], device=lv.device)
        if bool((lv.detach().flatten(1).abs().amax(1) * fresh).any()):
            raise ValueError(f"{op}: initial_state has non-zero levels for a sequence with tokens == 0")
    for (_, s, e), p0 in zip(segments(b, t, cu_seqlens), starts):
        if e > s and num_levels(p0 + e - s) > nl:
            raise ValueError(f"{op}: level_scales has L={nl} levels, but a sequence reaches position "
                             f"{p0 + e - s - 1}, which needs L >= bit_length({p0 + e - s - 1}) + 1 = "
                             f"{num_levels(p0 + e - s)}")
    return starts


def binary_carry(levels: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The carry of the recurrent form before writing the token at position `tokens` (per row, vectorised over
    levels, no host synchronisation): for position t >= 1 with m trailing zero bits, levels 0..m are added into level
    m + 1 and cleared. levels [B, H, L, K, V], tokens [B] int64; needs t < 2^(L-1)."""
    nl = levels.shape[2]
    lv = torch.arange(nl, device=levels.device, dtype=torch.int64)
    t = tokens.to(device=levels.device, dtype=torch.int64)[:, None]
    merge = (t % (1 << lv)[None] == 0) & (t > 0)  # [B, L]: levels 0..m (2^l divides t)
    target = torch.zeros_like(merge)
    target[:, 1:] = merge[:, :-1] & ~merge[:, 1:]  # level m + 1
    carry = (levels * merge[:, None, :, None, None].to(levels.dtype)).sum(2, keepdim=True)
    kept = levels * (~merge)[:, None, :, None, None].to(levels.dtype)
    return kept + target[:, None, :, None, None].to(levels.dtype) * carry


def check_step_state(op: str, q: torch.Tensor, v: torch.Tensor, level_scales: torch.Tensor, state) -> int:
    """Validate a decode step's level_scales [B, H, L] and state (LogLinearState, levels [B, H, Ls, K, V] with
    Ls <= L); return Ls. The position bound (tokens < 2^(Ls-1)) is a device-side assertion."""
    b, h, dk = q.shape
    dv = v.shape[-1]
    if not isinstance(state, LogLinearState):
        raise TypeError(f"{op}: state must be a LogLinearState, got {type(state).__name__}")
    lv, tok = state
    if lv.ndim != 5 or tuple(lv.shape[:2]) != (b, h) or tuple(lv.shape[3:]) != (dk, dv):
        raise ValueError(f"{op}: state.levels must be [B={b}, H={h}, Ls, K={dk}, V={dv}], got {tuple(lv.shape)}")
    if tuple(tok.shape) != (b,):
        raise ValueError(f"{op}: state.tokens must be [B={b}], got {tuple(tok.shape)}")
    if level_scales.ndim != 3 or tuple(level_scales.shape[:2]) != (b, h) or level_scales.shape[2] < lv.shape[2]:
        raise ValueError(f"{op}: level_scales must be [B={b}, H={h}, L] with L >= the state's {lv.shape[2]} "
                         f"levels, got {tuple(level_scales.shape)}")
    torch._assert_async((tok < (1 << (lv.shape[2] - 1))).all(),
                        f"{op}: state has too few levels for the position; grow it with LogLinearState.grow")
    return lv.shape[2]
