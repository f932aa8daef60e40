"""hla2's two and hla3's three linear_attn passes as one custom op pair each (where it applies, below).

As separate linear_attn ops, the passes' backward leaves full-size additions to autograd, each a read of two
[B, T, H, K] tensors and a write of one: for hla2 q's gradient from both passes (dq1 + dq2) and k's from the first
pass, where k is both the keys and the values (dk + dv); for hla3, q's from three passes and k's from the first two
(dk1 + dv1 + dk2). On the H200, hla2 at 16K x 2 (H = 16, K = V = 128, bf16) took 4.14 ms against 2 x 2.01 for its
two linear_attn passes alone. Here the backward kernels add them in place: a later pass's dq goes into
the next earlier pass's (linear_attn's chunk_bwd with dq_acc), and the first pass, whose values are the keys, stores
dk + dv itself (self_values): the same values, one gradient tensor each (hla3 keeps one addition, dk1 + dv1 + dk2).
hla2 at the same shape: 4.015 ms against 4.089 as separate passes (two rounds each), 3.899 with
linear_attn's backward at 4 warps (now its default).

It applies where the accumulating one-tile kernel takes those passes (hilo_kernels.linear_attn.triton_bwd.
fused_accumulation): fixed-length calls (initial and final states included) with normalize=False, K <= 128 (<= 64
in fp32); any V for hla2 (its second pass's backward is linear_attn's own; hla_mamba2's heads, K = 128 and V = 64,
are covered), V <= 128 (<= 64 in fp32) for hla3, whose second pass (Q, K, V) accumulates dq too. hla_compose falls
back to the separate passes otherwise.
"""

from typing import Optional

import torch
import triton

from hilo_kernels.common.compile import absent_grad, dense_outputs, grad_or_zeros, unused_grads_stay_none
from hilo_kernels.linear_attn.triton_bwd import _flat_inputs, chunk_bwd, fused_accumulation
from hilo_kernels.linear_attn.triton_fwd import BT, chunk_fwd

from .state import powered


def applies(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether op's ("hla2", "hla3") one op can take passes of these [B, T, H, K] queries and keys and [B, T, H, V]
    values: the first pass, whose values are the keys, must fit the accumulating one-tile backward kernel, and for
    hla3 the second pass (Q, K, V) as well."""
    flat = (lambda x: x.reshape(-1, x.shape[2], x.shape[3]))
    if op not in ("hla2", "hla3") or not fused_accumulation(flat(q), flat(k)):
        return False
    return op == "hla2" or fused_accumulation(flat(q), flat(v), self_values=False)


def _state(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:  # noqa: UP045
    return None if x is None else x.contiguous().float()


@torch.library.custom_op("hilo::hla2_passes", mutates_args=())
@dense_outputs
def _hla2_passes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],  # noqa: UP045
                 s0: Optional[torch.Tensor], f0: Optional[torch.Tensor], scale: float, p_in: float,  # noqa: UP045
                 p_out: float, output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o [B, T, H, V], K~ = LA(Q, K, K; p_in g) [B T, H, K], both passes' chunk states (kept for the backward),
    and with output_final_state the passes' final states S [B, H, K, K] and F [B, H, K, V] fp32, else empty);
    o = LA(Q, K~, V; p_out g). s0, f0: the passes' initial states or None."""
    qf, kf, vf, gf, _, lay = _flat_inputs(q, k, v, g, None)
    kt, s_fin, hs_in = chunk_fwd(qf, kf, kf, powered(gf, p_in), scale, _state(s0), lay, output_final_state)
    o, f_fin, hs_out = chunk_fwd(qf, kt, vf, powered(gf, p_out), scale, _state(f0), lay, output_final_state)
    if not output_final_state:
        s_fin, f_fin = (q.new_empty(0, dtype=torch.float32) for _ in range(2))
    return o.reshape(v.shape), kt, hs_in, hs_out, s_fin, f_fin


@_hla2_passes.register_fake
def _(q, k, v, g, s0, f0, scale, p_in, p_out, output_final_state):
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    rows = b * triton.cdiv(t, BT)
    fins = ((q.new_empty(b, h, dk, dk, dtype=torch.float32), q.new_empty(b, h, dk, dv, dtype=torch.float32))
            if output_final_state else (q.new_empty(0, dtype=torch.float32), q.new_empty(0, dtype=torch.float32)))
    return (v.new_empty(v.shape), k.new_empty(b * t, h, dk), k.new_empty(rows, h, dk, dk),
            k.new_empty(rows, h, dk, dv), *fins)


@torch.library.custom_op("hilo::hla2_passes_backward", mutates_args=())
@dense_outputs
def _hla2_passes_backward(do: torch.Tensor, ds: Optional[torch.Tensor], df: Optional[torch.Tensor],  # noqa: UP045
                          q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],  # noqa: UP045
                          s0: Optional[torch.Tensor], f0: Optional[torch.Tensor], kt: torch.Tensor,  # noqa: UP045
                          hs_in: torch.Tensor, hs_out: torch.Tensor, scale: float, p_in: float,
                          p_out: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                 torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, ds0, df0; empty for an absent g or initial state): the second pass's backward, then the
    first's with the second's dq added and its keys' and values' gradients summed inside the kernel. ds, df: the
    final states' gradients or None."""
    qf, kf, vf, gf, _, lay = _flat_inputs(q, k, v, g, None)
    dof = do.reshape(vf.shape).contiguous().to(vf.dtype)
    dq_out, dkt, dv, dg_out, df0 = chunk_bwd(qf, kt, vf, powered(gf, p_out), dof, _state(df), hs_out, scale,
                                             _state(f0), lay, need_dh0=f0 is not None)
    dq, dk, _, dg_in, ds0 = chunk_bwd(qf, kf, kf, powered(gf, p_in), dkt, _state(ds), hs_in, scale, _state(s0),
                                      lay, need_dh0=s0 is not None, dq_acc=dq_out, self_values=True)
    dg = absent_grad(q) if g is None else (p_in * dg_in + p_out * dg_out).reshape(g.shape).to(g.dtype)
    return (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), dg,
            absent_grad(q) if s0 is None else ds0.to(s0.dtype), absent_grad(q) if f0 is None else df0.to(f0.dtype))


@_hla2_passes_backward.register_fake
def _(do, ds, df, q, k, v, g, s0, f0, kt, hs_in, hs_out, scale, p_in, p_out):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            absent_grad(q) if g is None else g.new_empty(g.shape),
            absent_grad(q) if s0 is None else s0.new_empty(s0.shape),
            absent_grad(q) if f0 is None else f0.new_empty(f0.shape))


def _setup(ctx, inputs, output):
    q, k, v, g, s0, f0, scale, p_in, p_out, output_final_state = inputs
    _, kt, hs_in, hs_out, _, _ = output
    ctx.save_for_backward(q, k, v, g, s0, f0, kt, hs_in, hs_out)
    ctx.args = (scale, p_in, p_out)
    ctx.output_final_state = output_final_state
    unused_grads_stay_none(ctx, output)


def _grads(ctx, do, _dkt, _dhs_in, _dhs_out, ds, df):
    q, k, v, g, s0, f0, kt, hs_in, hs_out = ctx.saved_tensors
    do = grad_or_zeros(ctx, do)
    if not ctx.output_final_state:
        ds = df = None
    dq, dk, dv, dg, ds0, df0 = _hla2_passes_backward(do, ds, df, q, k, v, g, s0, f0, kt, hs_in, hs_out, *ctx.args)
    return (dq, dk, dv, (dg if g is not None else None), (ds0 if s0 is not None else None),
            (df0 if f0 is not None else None), None, None, None, None)


_hla2_passes.register_autograd(_grads, setup_context=_setup)


def hla2_passes(q, k, v, g, s0, f0, scale: float, p_in: float, p_out: float, output_final_state: bool):
    """(o, (S, F) or None) of hla2's passes LA(Q, LA(Q, K, K; p_in g), V; p_out g) from initial states s0, f0 (or
    None): q, k [B, T, H, K], v [B, T, H, V] in the passes' dtype, g [B, T, H] fp32 or None (applies(q, k) must
    hold)."""
    c = (lambda x: None if x is None else x.contiguous())
    o, _, _, _, s_fin, f_fin = _hla2_passes(c(q), c(k), c(v), c(g), c(s0), c(f0), float(scale), float(p_in),
                                            float(p_out), bool(output_final_state))
    return o, ((s_fin, f_fin) if output_final_state else None)


@torch.library.custom_op("hilo::hla3_passes", mutates_args=())
@dense_outputs
def _hla3_passes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],  # noqa: UP045
                 s0: Optional[torch.Tensor], p0: Optional[torch.Tensor], f0: Optional[torch.Tensor],  # noqa: UP045
                 scale: float, output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o [B, T, H, V], K~ = LA(Q, K, K; 2g) [B T, H, K], V~ = LA(Q, K, V; g) [B T, H, V], the three passes'
    chunk states (kept for the backward), and with output_final_state the final states S [B, H, K, K], P and F
    [B, H, K, V] fp32, else empty); o = LA(Q, K~, V~; g). s0, p0, f0: the passes' initial states or None."""
    qf, kf, vf, gf, _, lay = _flat_inputs(q, k, v, g, None)
    kt, s_fin, hs_s = chunk_fwd(qf, kf, kf, powered(gf, 2), scale, _state(s0), lay, output_final_state)
    vt, p_fin, hs_p = chunk_fwd(qf, kf, vf, gf, scale, _state(p0), lay, output_final_state)
    o, f_fin, hs_f = chunk_fwd(qf, kt, vt, gf, scale, _state(f0), lay, output_final_state)
    if not output_final_state:
        s_fin, p_fin, f_fin = (q.new_empty(0, dtype=torch.float32) for _ in range(3))
    return o.reshape(v.shape), kt, vt, hs_s, hs_p, hs_f, s_fin, p_fin, f_fin


@_hla3_passes.register_fake
def _(q, k, v, g, s0, p0, f0, scale, output_final_state):
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    rows = b * triton.cdiv(t, BT)
    if output_final_state:
        fins = [q.new_empty(b, h, dk, x, dtype=torch.float32) for x in (dk, dv, dv)]
    else:
        fins = [q.new_empty(0, dtype=torch.float32) for _ in range(3)]
    return (v.new_empty(v.shape), k.new_empty(b * t, h, dk), v.new_empty(b * t, h, dv), k.new_empty(rows, h, dk, dk),
            k.new_empty(rows, h, dk, dv), k.new_empty(rows, h, dk, dv), *fins)


@torch.library.custom_op("hilo::hla3_passes_backward", mutates_args=())
@dense_outputs
def _hla3_passes_backward(do: torch.Tensor, ds: Optional[torch.Tensor], dp: Optional[torch.Tensor],  # noqa: UP045
                          df: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # noqa: UP045
                          g: Optional[torch.Tensor], s0: Optional[torch.Tensor],  # noqa: UP045
                          p0: Optional[torch.Tensor],  # noqa: UP045
                          f0: Optional[torch.Tensor], kt: torch.Tensor, vt: torch.Tensor,  # noqa: UP045
                          hs_s: torch.Tensor, hs_p: torch.Tensor, hs_f: torch.Tensor,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                 torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, ds0, dp0, df0; empty for an absent g or initial state): the outer pass's backward, then V~'s
    with the outer dq added in its kernel, then K~'s with both added and its keys' and values' gradients summed. ds,
    dp, df: the final states' gradients or None."""
    qf, kf, vf, gf, _, lay = _flat_inputs(q, k, v, g, None)
    dof = do.reshape(vf.shape).contiguous().to(vf.dtype)
    dq_f, dkt, dvt, dg_f, df0 = chunk_bwd(qf, kt, vt, gf, dof, _state(df), hs_f, scale, _state(f0), lay,
                                          need_dh0=f0 is not None)
    dq_pf, dk_p, dv, dg_p, dp0 = chunk_bwd(qf, kf, vf, gf, dvt, _state(dp), hs_p, scale, _state(p0), lay,
                                           need_dh0=p0 is not None, dq_acc=dq_f)
    dq, dk_s, _, dg_s, ds0 = chunk_bwd(qf, kf, kf, powered(gf, 2), dkt, _state(ds), hs_s, scale, _state(s0), lay,
                                       need_dh0=s0 is not None, dq_acc=dq_pf, self_values=True)
    dg = absent_grad(q) if g is None else (2 * dg_s + dg_p + dg_f).reshape(g.shape).to(g.dtype)
    dk = dk_s + dk_p  # the one addition left (autograd would make two more, and one for dq)
    return (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), dg,
            *(absent_grad(q) if x0 is None else dx0.to(x0.dtype) for x0, dx0 in ((s0, ds0), (p0, dp0), (f0, df0))))


@_hla3_passes_backward.register_fake
def _(do, ds, dp, df, q, k, v, g, s0, p0, f0, kt, vt, hs_s, hs_p, hs_f, scale):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            absent_grad(q) if g is None else g.new_empty(g.shape),
            *(absent_grad(q) if x0 is None else x0.new_empty(x0.shape) for x0 in (s0, p0, f0)))


def _setup3(ctx, inputs, output):
    q, k, v, g, s0, p0, f0, scale, output_final_state = inputs
    _, kt, vt, hs_s, hs_p, hs_f, _, _, _ = output
    ctx.save_for_backward(q, k, v, g, s0, p0, f0, kt, vt, hs_s, hs_p, hs_f)
    ctx.scale = scale
    ctx.output_final_state = output_final_state
    unused_grads_stay_none(ctx, output)


def _grads3(ctx, do, _dkt, _dvt, _dhs_s, _dhs_p, _dhs_f, ds, dp, df):
    q, k, v, g, s0, p0, f0, kt, vt, hs_s, hs_p, hs_f = ctx.saved_tensors
    do = grad_or_zeros(ctx, do)
    if not ctx.output_final_state:
        ds = dp = df = None
    dq, dk, dv, dg, ds0, dp0, df0 = _hla3_passes_backward(do, ds, dp, df, q, k, v, g, s0, p0, f0, kt, vt, hs_s,
                                                          hs_p, hs_f, ctx.scale)
    return (dq, dk, dv, (dg if g is not None else None), *(d0 if x0 is not None else None
                                                             for x0, d0 in ((s0, ds0), (p0, dp0), (f0, df0))),
            None, None)


_hla3_passes.register_autograd(_grads3, setup_context=_setup3)


def hla3_passes(q, k, v, g, s0, p0, f0, scale: float, output_final_state: bool):
    """(o, (S, P, F) or None) of hla3's passes LA(Q, LA(Q, K, K; 2g), LA(Q, K, V; g); g) from initial states s0, p0,
    f0 (or None): q, k [B, T, H, K], v [B, T, H, V] in the passes' dtype, g [B, T, H] fp32 or None
    (applies("hla3", q, k, v) must hold)."""
    c = (lambda x: None if x is None else x.contiguous())
    out = _hla3_passes(c(q), c(k), c(v), c(g), c(s0), c(p0), c(f0), float(scale), bool(output_final_state))
    return out[0], (tuple(out[6:]) if output_final_state else None)
