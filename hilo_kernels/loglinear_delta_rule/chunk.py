"""Chunked log-linear Gated DeltaNet in PyTorch: the level engine of hilo_kernels.loglinear_attn.chunk with the delta
rule's per-chunk pieces (exact, differentiable by autograd, the CPU path).

Per chunk (C tokens, gamma the in-chunk inclusive cumsum of g, Gamma_ts = exp(gamma_t - gamma_s) on s <= t), the
WY/UT form of the transitions:
    A = strict_lower(diag(beta) (K K^T * Gamma)),   X = (I + A)^{-1} diag(beta)
    E = (Q K^T * Gamma) X                          E[t, s] = q_t^T P_{t<-s} beta_s k_s  (the dense block)
    W = X diag(e^gamma) K,   q_eff = diag(e^gamma) Q - (Q K^T * Gamma) W      (q_eff_t S = q_t^T P_{t<-start} S)
    Kd = diag(e^(gamma_C - gamma)) K
    M = e^(gamma_C) I - Kd^T W                      (a state through the chunk: S -> M S, the Householder product)
    zcols = Kd^T X                                  (column s = P_{end<-s} beta_s k_s),   local = zcols V
Every level state (a chunk-level bucket or a prior level) goes through the same M per chunk, so the levels need no
per-level recomputation of the Householder product: cost O(T C (C + K + V) + (T/C) K^2 V log(T/C)).
"""

import torch

from hilo_kernels.loglinear_attn.chunk import _decay_matrices, loglinear_chunk

from .tril_inverse import unit_lower_inverse

__all__ = ["delta_wy_pieces", "loglinear_delta_rule_chunk", "prepare_delta", "wy_after_inverse", "wy_before_inverse"]


def prepare_delta(q, k, v, gamma, beta):
    """Per-chunk pieces for the delta rule; q, k [b, h, n, C, K], v [.., C, V], gamma, beta [b, h, n, C]."""
    e, q_eff, w, kd, zcols = delta_wy_pieces(q, k, gamma, beta)
    ident = torch.eye(k.shape[-1], dtype=q.dtype, device=q.device)
    trans = gamma[..., -1].exp()[..., None, None] * ident - kd.transpose(-1, -2) @ w
    return e, q_eff, trans, zcols @ v, zcols


def wy_before_inverse(q, k, gamma, beta):
    """(A, Q K^T * Gamma) of the docstring: the pieces before (I + A)^{-1}."""
    decay, causal = _decay_matrices(gamma)
    c = gamma.shape[-1]
    strict = causal & ~torch.eye(c, dtype=torch.bool, device=q.device)
    a = beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay * strict
    return a, (q @ k.transpose(-1, -2)) * decay


def wy_after_inverse(inv, q, k, gamma, beta, qk):
    """(E, q_eff, W, Kd, zcols) of the docstring from inv = (I + A)^{-1} and qk = Q K^T * Gamma."""
    x = inv * beta[..., None, :]  # (I + A)^{-1} diag(beta)
    e = qk @ x
    w = x @ (k * gamma.exp()[..., None])
    q_eff = q * gamma.exp()[..., None] - qk @ w
    kd = k * (gamma[..., -1:] - gamma).exp()[..., None]
    return e, q_eff, w, kd, kd.transpose(-1, -2) @ x


def delta_wy_pieces(q, k, gamma, beta, inverse="torch"):
    """(E, q_eff, W, Kd, zcols) of the docstring: the transition is M = exp(gamma_C) I - Kd^T W. inverse: the
    backend of (I + A)^{-1} (tril_inverse.unit_lower_inverse: "torch" solves, "triton" runs its kernel)."""
    a, qk = wy_before_inverse(q, k, gamma, beta)
    return wy_after_inverse(unit_lower_inverse(a, inverse), q, k, gamma, beta, qk)


def loglinear_delta_rule_chunk(q, k, v, beta, g, level_scales, scale, initial_state, output_final_state,
                               cu_seqlens, starts):
    """Same contract as loglinear_delta_rule_naive (o in v's dtype, final levels [N, H, L, K, V] or None)."""
    return loglinear_chunk(q, k, v, beta, g, level_scales, scale, initial_state, output_final_state, cu_seqlens,
                           starts, prepare_delta, v.dtype)
