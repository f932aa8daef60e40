"""Input validation and backend choice for the recurrent operators (the conventions of docs/kernels.md).

Every error names the operator and says what was expected. Values of a CUDA cu_seqlens and g are checked with
torch._assert_async (a device-side assertion, no host synchronisation); CPU ones are checked on the host with a
readable error. The gates (g, beta) and level_scales are keyword-only arguments (`keyword_gates`).
"""

import functools
import itertools
import os

import torch

BACKENDS = ("triton", "torch", "naive")
_IO_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
# The delta-rule operators (delta_rule, loglinear_delta_rule) take value heads up to twice as wide: all their kernels
# hold the whole K in a tile but loop or block over V, so Gated DeltaNet's K = 256, V = 512 heads can run in one call
# and do the K-only work (the WY/UT form, (I + A)^{-1}, their gradients) once. Exact on CPU (fp32, interpreter); in
# bf16 on the GPU not yet checked at V > 256, so the GDN layers still call per 256 columns by default.
MAX_DELTA_VALUE_DIM = 512


def _check_4d(op: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != 4:
        raise ValueError(f"{op}: {name} must be 4-D [B, T, H, D], got shape {tuple(t.shape)}")


def keyword_gates(*names: str):
    """Decorate an operator whose arguments after q, k, v are keyword-only, so that a call passing more than three
    arguments by position fails with the keyword form to use: the gates of fla's operators come in other orders
    (chunk_gated_delta_rule(q, k, v, g, beta)), and a positional beta read as g (or g as beta) would run without
    error on wrong values."""

    def decorate(fn):
        form = ", ".join(f"{n}={n}" for n in names)

        @functools.wraps(fn)
        def wrapper(q, k, v, *args, **kwargs):
            if args:
                raise TypeError(f"{fn.__name__}: {', '.join(names)} are keyword-only arguments: call "
                                f"{fn.__name__}(q, k, v, {form}, ...); got {3 + len(args)} positional arguments")
            return fn(q, k, v, **kwargs)

        return wrapper

    return decorate


def check_log_decays(op: str, g: torch.Tensor) -> None:
    """g must hold natural-log decays, g <= 0 (the state is multiplied by exp(g) <= 1). A CPU g is checked on the
    host; elsewhere, and in a graph torch.compile traces, the check is a device-side assertion (torch._assert_async:
    no host synchronisation), which stops the process with a device-side assert. NaN passes: a non-finite forward
    is the training loop's to skip."""
    positive = (g > 0).any()
    message = (f"{op}: g must hold log decays (g <= 0: the state is multiplied by exp(g)), got a positive value; "
               f"pass the logarithm of the decay, e.g. g = -softplus(x), logsigmoid(x) or -exp(A_log) * softplus(dt), "
               f"by keyword (g=...)")
    if g.device.type == "cpu" and not torch.compiler.is_compiling():
        if positive:
            raise ValueError(message)
    else:  # also under torch.compile, where a host read would break the graph (a RuntimeError on the CPU)
        torch._assert_async(~positive, message)


def check_recurrent_inputs(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "triton",
    grouped: bool = False,
    max_dv: int = MAX_HEAD_DIM,
) -> int:
    """Validate q, k [B, T, H, K], v [B, T, H, V], g / beta [B, T, H] (g <= 0: check_log_decays), initial_state
    [N, H, K, V] (fp32) and cu_seqlens [N+1]; return N, the number of sequences (B, or len(cu_seqlens) - 1).
    float64 inputs are accepted by the "torch" and "naive" backends only (for float64 reference gradients).
    grouped: q and k may have G heads shared by groups of H / G consecutive heads of v (G divides H; Mamba-2's
    n_groups). K must be at most MAX_HEAD_DIM and V at most max_dv (the operator's own limit: MAX_HEAD_DIM, or
    MAX_DELTA_VALUE_DIM)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_4d(op, name, t)
    allowed = _IO_DTYPES if backend == "triton" else _IO_DTYPES + (torch.float64,)
    if q.dtype not in allowed:
        raise TypeError(f"{op}: q, k, v must be float32, float16 or bfloat16"
                        f"{' (or float64 off the triton backend)' if backend == 'triton' else ' or float64'}, "
                        f"got {q.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{op}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{op}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape != k.shape:
        raise ValueError(f"{op}: q and k must have the same shape [B, T, H, K], got q {tuple(q.shape)} and "
                         f"k {tuple(k.shape)}")
    b, t, h, dk = q.shape
    if grouped and v.shape[:2] == (b, t) and v.shape[2] != h:
        if v.shape[2] % h != 0:
            raise ValueError(f"{op}: grouped q and k have G={h} heads, which must divide v's H={v.shape[2]} heads "
                             f"(each group of H / G heads shares one q and k); got q {tuple(q.shape)}, "
                             f"v {tuple(v.shape)}")
        h = v.shape[2]
    if v.shape[:3] != (b, t, h):
        raise ValueError(f"{op}: v must be [B={b}, T={t}, H={h}, V] to match q, got {tuple(v.shape)}")
    dv = v.shape[3]
    if not (0 < dk <= MAX_HEAD_DIM and 0 < dv <= max_dv):
        fix = ""
        if dk > MAX_HEAD_DIM:
            fix += f"; K > {MAX_HEAD_DIM} is not supported (the kernels hold all of K in one tile)"
        if dv > max_dv:
            fix += (f"; run wider value heads in column blocks of at most {max_dv} and concatenate the outputs and "
                    "states (exact: every value column is computed on its own)")
        raise ValueError(f"{op}: head dims must be in 1..{MAX_HEAD_DIM} for K and 1..{max_dv} for V, got K={dk}, "
                         f"V={dv}{fix}")
    for name, x in (("g", g), ("beta", beta)):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor [B, T, H] or None, got {type(x).__name__}")
        if tuple(x.shape) != (b, t, h):
            raise ValueError(f"{op}: {name} must have shape [B={b}, T={t}, H={h}], got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{op}: {name} must be a floating tensor (float32 for g), got {x.dtype}")
        if name == "g" and x.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{op}: g (log decay) must be float32, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{op}: {name} must be on {q.device} like q, got {x.device}")
    if g is not None:
        check_log_decays(op, g)
    n = b
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.ndim != 1 or cu_seqlens.dtype not in (
            torch.int32, torch.int64
        ):
            raise TypeError(f"{op}: cu_seqlens must be a 1-D int32/int64 tensor [N+1] of document boundaries")
        if b != 1:
            raise ValueError(f"{op}: cu_seqlens needs packed inputs with B == 1, got B={b}")
        if cu_seqlens.numel() < 2:
            raise ValueError(f"{op}: cu_seqlens must hold N+1 >= 2 boundaries, got {cu_seqlens.numel()}")
        if cu_seqlens.device.type not in ("cpu", q.device.type):
            raise ValueError(f"{op}: cu_seqlens must be on {q.device} like q (or on the CPU), got "
                             f"{cu_seqlens.device}")
        n = cu_seqlens.numel() - 1
        if cu_seqlens.device.type == "cpu":
            bounds = cu_seqlens.tolist()
            if bounds[0] != 0 or bounds[-1] != t or any(x > y for x, y in itertools.pairwise(bounds)):
                raise ValueError(f"{op}: cu_seqlens must start at 0, never decrease and end at T={t}, got "
                                 f"{bounds}")
        else:
            ok = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == t) & (cu_seqlens[1:] >= cu_seqlens[:-1]).all()
            torch._assert_async(ok, f"{op}: cu_seqlens must start at 0, never decrease and end at T={t}")
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"{op}: initial_state must be a torch.Tensor [N, H, K, V] or None")
        if tuple(initial_state.shape) != (n, h, dk, dv):
            raise ValueError(f"{op}: initial_state must have shape [N={n}, H={h}, K={dk}, V={dv}], got "
                             f"{tuple(initial_state.shape)}")
        if initial_state.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{op}: initial_state must be float32, got {initial_state.dtype}")
        if initial_state.device != q.device:
            raise ValueError(f"{op}: initial_state must be on {q.device} like q, got {initial_state.device}")
    return n


def resolve_backend(op: str, backend: str | None, device: torch.device) -> str:
    """None -> "triton" on CUDA, "torch" elsewhere. "triton" on CPU tensors needs TRITON_INTERPRET=1 set
    before the kernels were imported."""
    if backend is None:
        return "triton" if device.type == "cuda" else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"{op}: unknown backend {backend!r}; expected one of {BACKENDS} or None")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{op}: backend='triton' on {device.type} tensors runs only under the Triton "
                           "interpreter: set TRITON_INTERPRET=1 before importing kernels (or use CUDA tensors, "
                           "or backend='torch')")
    return backend
