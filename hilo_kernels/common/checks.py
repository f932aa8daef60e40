"""The bf16 check contract of the recurrent operators: for each op (CASES), how to make its inputs, how to call it,
which gradients it has and their tolerances, and check(), which runs the op's GPU backend on bf16 inputs against
its fp32 oracle on the same values (output, final state and every gradient, on a small odd-length batch and on a
packed varlen batch). tests/kernels/test_gpu_bf16.py asserts it on a GPU; benchmarks/operators.py prints it before
it times the same cases. Tolerances and the error ratio are documented in docs/kernels.md. Imports torch and
kernels only.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hilo_kernels.common.metrics import error_ratio

OUT_TOL = 5e-3  # outputs and final states, bf16 vs the fp32 oracle (docs/kernels.md)
QKV_TOL = 1e-2
GATE_TOL = 2e-2


@dataclass
class OpCase:
    """make(B, T, H, D, device, seed) -> dict of fp32 input tensors (names in call order; g/beta fp32 always,
    'initial_state' [N, H, D, D] optional); call(inputs, cu_seqlens, backend) -> (o, final_state tensor).
    grad_tol maps each differentiable input name to its gradient tolerance. backend is the one checked and
    timed; baselines maps extra row labels to other backends of the same op, checked and timed beside it."""

    make: Callable[..., dict]
    call: Callable[..., tuple]
    grad_tol: dict = field(default_factory=dict)
    oracle: str = "naive"  # the log-linear ops: "torch" (their token recurrence is too slow at the check shapes)
    backend: str = "triton"
    baselines: dict = field(default_factory=dict)


# the value head dim of the cases' inputs (None: the same as q's and k's); benchmarks/operators.py --dim-v sets it for
# its timed and profiled calls, the checks keep K = V
VALUE_DIM = None


def _qkv(b, t, h, d, device, gen):
    q = torch.randn(b, t, h, d, device=device, generator=gen)
    k = torch.randn(b, t, h, d, device=device, generator=gen)
    v = torch.randn(b, t, h, VALUE_DIM or d, device=device, generator=gen)
    return q, k, v


def _make_linear_attn(b, t, h, d, device, seed=0, n_state=None):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = _qkv(b, t, h, d, device, gen)
    # Mamba-2-like decays: g = -exp(A_log) * softplus(dt), per-token in (-0.3, 0)
    g = -0.3 * torch.rand(b, t, h, device=device, generator=gen)
    out = {"q": q, "k": k, "v": v, "g": g}
    if n_state is not None:
        out["initial_state"] = torch.randn(n_state, h, d, d, device=device, generator=gen)
    return out


def _call_linear_attn(x, cu_seqlens, backend):
    from hilo_kernels import linear_attn

    return linear_attn(x["q"], x["k"], x["v"], g=x["g"], initial_state=x.get("initial_state"),
                       output_final_state=True, cu_seqlens=cu_seqlens, backend=backend)


def _make_delta_rule(b, t, h, d, device, seed=0, n_state=None):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = _qkv(b, t, h, d, device, gen)
    # As the Gated DeltaNet layer feeds it: L2-normalised k, beta = sigmoid(.), g = -exp(A_log) * softplus(.).
    k = torch.nn.functional.normalize(k, dim=-1)
    beta = torch.rand(b, t, h, device=device, generator=gen).sigmoid()
    g = -0.3 * torch.rand(b, t, h, device=device, generator=gen)
    out = {"q": q, "k": k, "v": v, "beta": beta, "g": g}
    if n_state is not None:
        out["initial_state"] = torch.randn(n_state, h, d, d, device=device, generator=gen)
    return out


def _call_delta_rule(x, cu_seqlens, backend):
    from hilo_kernels import delta_rule

    return delta_rule(x["q"], x["k"], x["v"], beta=x["beta"], g=x["g"], initial_state=x.get("initial_state"),
                      output_final_state=True, cu_seqlens=cu_seqlens, backend=backend)


def _make_hla(b, t, h, d, device, seed=0, n_state=None, fields=2):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = _qkv(b, t, h, d, device, gen)
    # As the HLA layer feeds it: L2-normalised q and k (scale 1), a Mamba-2-like per-token decay.
    q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    g = -0.3 * torch.rand(b, t, h, device=device, generator=gen)
    out = {"q": q, "k": k, "v": v, "g": g}
    if n_state is not None:  # the op's state fields (two; hla3 three) [N, H, D, D] side by side in one tensor
        out["initial_state"] = 0.1 * torch.randn(n_state, h, d, fields * d, device=device, generator=gen)
    return out


def _call_hla(op):
    def call(x, cu_seqlens, backend):
        import hilo_kernels
        from hilo_kernels.hla.state import STATE_TYPES

        h0 = x.get("initial_state")
        d = x["q"].shape[-1]
        h0 = None if h0 is None else STATE_TYPES[op](*h0.split(d, dim=-1))
        o, state = getattr(hilo_kernels, op)(x["q"], x["k"], x["v"], g=x["g"], initial_state=h0, output_final_state=True,
                                        cu_seqlens=cu_seqlens, backend=backend)
        return o, torch.cat(list(state), dim=-1)

    return call


PRIOR_TOKENS = 100  # log-linear checks: the initial state's sequences already consumed this many tokens


def _with_levels(x, b, t, h, d, device, gen, n_state):
    """Add level_scales (softplus-like values around 1) and, with n_state, the initial per-level state."""
    from hilo_kernels.loglinear_attn import num_levels

    nl = num_levels(t + (PRIOR_TOKENS if n_state is not None else 0))
    x.pop("initial_state", None)
    x["level_scales"] = 0.5 + torch.rand(b, t, h, nl, device=device, generator=gen)
    if n_state is not None:
        x["initial_levels"] = torch.randn(n_state, h, nl, d, d, device=device, generator=gen) / nl
    return x


def _prior(x):
    from hilo_kernels.loglinear_attn import LogLinearState

    levels = x.get("initial_levels")
    if levels is None:
        return None
    return LogLinearState(levels, torch.full((levels.shape[0],), PRIOR_TOKENS, device=levels.device))


def _make_loglinear_attn(b, t, h, d, device, seed=0, n_state=None):
    x = _make_linear_attn(b, t, h, d, device, seed, n_state)
    return _with_levels(x, b, t, h, d, device, torch.Generator(device=device).manual_seed(seed + 1), n_state)


def _call_loglinear_attn(x, cu_seqlens, backend):
    from hilo_kernels import loglinear_attn

    o, st = loglinear_attn(x["q"], x["k"], x["v"], g=x["g"], level_scales=x["level_scales"], initial_state=_prior(x),
                           output_final_state=True, cu_seqlens=cu_seqlens, backend=backend)
    return o, st.levels


def _make_loglinear_delta_rule(b, t, h, d, device, seed=0, n_state=None):
    x = _make_delta_rule(b, t, h, d, device, seed, n_state)
    return _with_levels(x, b, t, h, d, device, torch.Generator(device=device).manual_seed(seed + 1), n_state)


def _call_loglinear_delta_rule(x, cu_seqlens, backend):
    from hilo_kernels import loglinear_delta_rule

    o, st = loglinear_delta_rule(x["q"], x["k"], x["v"], beta=x["beta"], g=x["g"], level_scales=x["level_scales"],
                                 initial_state=_prior(x), output_final_state=True, cu_seqlens=cu_seqlens,
                                 backend=backend)
    return o, st.levels


CASES: dict[str, OpCase] = {
    "linear_attn": OpCase(_make_linear_attn, _call_linear_attn,
                          {"q": QKV_TOL, "k": QKV_TOL, "v": QKV_TOL, "g": GATE_TOL, "initial_state": QKV_TOL}),
    "delta_rule": OpCase(_make_delta_rule, _call_delta_rule,
                         {"q": QKV_TOL, "k": QKV_TOL, "v": QKV_TOL, "beta": GATE_TOL, "g": GATE_TOL,
                          "initial_state": QKV_TOL}),
    "loglinear_attn": OpCase(_make_loglinear_attn, _call_loglinear_attn,
                             {"q": QKV_TOL, "k": QKV_TOL, "v": QKV_TOL, "g": GATE_TOL, "level_scales": GATE_TOL,
                              "initial_levels": QKV_TOL}, oracle="torch"),
    "loglinear_delta_rule": OpCase(_make_loglinear_delta_rule, _call_loglinear_delta_rule,
                                   {"q": QKV_TOL, "k": QKV_TOL, "v": QKV_TOL, "beta": GATE_TOL, "g": GATE_TOL,
                                    "level_scales": GATE_TOL, "initial_levels": QKV_TOL}, oracle="torch"),
    # the fused chunked kernels, with the two-pass compositions over linear_attn's Triton kernels beside them
    # (hilo_kernels.hla.compose)
    **{op: OpCase(_make_hla, _call_hla(op),
                  {"q": QKV_TOL, "k": QKV_TOL, "v": QKV_TOL, "g": GATE_TOL, "initial_state": QKV_TOL},
                  backend="fused", baselines={f"{op}_compose": "triton"}) for op in ("hla2", "ahla")},
    # third order: the three-pass composition only (hilo_kernels.hla.compose)
    "hla3": OpCase(functools.partial(_make_hla, fields=3), _call_hla("hla3"),
                   {"q": QKV_TOL, "k": QKV_TOL, "v": QKV_TOL, "g": GATE_TOL, "initial_state": QKV_TOL},
                   backend="triton"),
}


def make_leaves(inputs, dtype):
    """Detached leaves requiring grad: q/k/v/beta-like activations in `dtype`, g and states in fp32."""
    out = {}
    for name, x in inputs.items():
        keep_fp32 = name in ("g", "initial_state", "level_scales", "initial_levels") or x.dtype != torch.float32
        out[name] = x.detach().to(torch.float32 if keep_fp32 else dtype).requires_grad_()
    return out


def run_with_grads(case, inputs, cu, backend, dtype, seed=11):
    """(o, final state, {input name: gradient}) of one call of the op on `backend`, the activations in `dtype`,
    for the loss <o, do> + <state, ds> with random do, ds drawn from `seed`."""
    x = make_leaves(inputs, dtype)
    o, s = case.call(x, cu, backend)
    gen = torch.Generator(device=o.device).manual_seed(seed)
    do = torch.randn(o.shape, device=o.device, generator=gen)
    ds = torch.randn(s.shape, device=o.device, generator=gen)
    loss = (o.float() * do).sum() + (s.float() * ds).sum()
    names = [n for n in x if n in case.grad_tol]
    grads = torch.autograd.grad(loss, [x[n] for n in names])
    return o, s, dict(zip(names, grads))


def variants(name: str, case: OpCase) -> list[tuple[str, str]]:
    """(row label, backend) of the op's own backend and its baselines."""
    return [(name, case.backend), *case.baselines.items()]


def check(name: str, case: OpCase, device: str) -> list[tuple[str, str, float, float]]:
    """Rows (shape, quantity, error ratio, tolerance) for bf16 on the op's backend vs fp32 naive; the shape
    label names the baseline for a baseline's rows."""
    rows = []
    shapes = [("B2 T777 H4 D128", 2, 777, 4, 128, None), ("varlen 1,15,700,333 H4 D128", 1, 1049, 4, 128,
                                                             [0, 1, 16, 716, 1049])]
    for label, b, t, h, d, bounds in shapes:
        n = b if bounds is None else len(bounds) - 1
        cu = None if bounds is None else torch.tensor(bounds, device=device, dtype=torch.int32)
        inputs = case.make(b, t, h, d, device, seed=0, n_state=n)
        ro, rs, rg = run_with_grads(case, inputs, cu, case.oracle, torch.float32)
        for variant, backend in variants(name, case):
            shape = label if variant == name else f"{label} ({variant})"
            try:
                o, s, g = run_with_grads(case, inputs, cu, backend, torch.bfloat16)
            except Exception as e:  # noqa: BLE001 (one failing backend, e.g. OutOfResources, must not hide the others)
                rows.append((shape, f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:100]}", float("nan"),
                             OUT_TOL))
                continue
            rows.append((shape, "o", error_ratio(o, ro), OUT_TOL))
            rows.append((shape, "final_state", error_ratio(s, rs), OUT_TOL))
            for gname, tol in case.grad_tol.items():
                if gname in g:
                    rows.append((shape, "d" + gname, error_ratio(g[gname], rg[gname]), tol))
    return rows


