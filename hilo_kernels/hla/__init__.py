"""Higher-order linear attention (docs/kernels.md): masked second-order HLA (`hla2`), asymmetric HLA (`ahla`) and masked
third-order HLA (`hla3`), per head, with q multiplied by `scale` (it enters every pass, so hla2 and ahla scale
as scale^2 and hla3 as scale^3), b_t = prod_{r <= t} exp(g_r) within a document:

    hla2 "d1"  o_t = sum_{i <= j <= t} (b_t/b_i)(b_j/b_i) (q_t.k_i)(k_i.q_j) v_j     (decay mask on A = q k^T)
    hla2 "d2"  o_t = sum_{i <= j <= t} (b_t/b_i)(b_t/b_j) (q_t.k_i)(k_i.q_j) v_j     ("decay every summary")
    ahla       o_t = sum_{j <= i <= t} (b_t/b_j) (q_t.k_i)(q_i.k_j) v_j
    hla3       o_t = sum_{i, l <= j <= t} (b_t/b_i)(b_j/b_i)(b_j/b_l) (q_t.k_i)(k_i.q_j)(q_j.k_l) v_l

(hilo_kernels.hla.naive gives the masked-matrix forms). Backends:
  "torch"   the exact composition of linear_attn passes (hilo_kernels.hla.compose) over linear_attn's chunked
            PyTorch path; the default off CUDA;
  "triton"  the same composition over linear_attn's Triton kernels, forward and backward: for bf16 inputs of
            hla2 and hla3 in bf16 ("compose16", see hilo_kernels.hla.compose), else in fp32. The default on CUDA for hla3, and for hla2 with bf16 inputs (4.4-4.9 ms
            fwd+bwd at 16K x 2 on the H200 against the fused kernels' 7.1, within the bf16 check);
  "fused"   hla2 and ahla: the chunked second-order algorithm in Triton
            (hilo_kernels.hla.triton_fused), the inner and outer states (S and F; P and E) carried in fp32 and the
            inputs read in their own dtype, forward and backward; the default on CUDA for ahla, and for hla2 with
            fp32 / fp16 inputs (~20x faster than fp32 passes); on CPU tensors it needs TRITON_INTERPRET=1, like
            "triton";
  "naive"   the token recurrences of hilo_kernels.hla.naive: the oracle.
States: hilo_kernels.hla.state (HLA2State, AHLAState, HLA3State). Decode: hla2_step, ahla_step, hla3_step.
"""

import torch

from hilo_kernels.common.precision import autocast_off
from hilo_kernels.common.validate import check_recurrent_inputs, keyword_gates, resolve_backend

from .compose import compose16, hla_compose
from .naive import hla2_chunked, hla_masked, hla_recurrent
from .state import AHLAState, HLA2State, HLA3State, check_state, decay_powers
from .step import ahla_step, hla2_step, hla3_step, hla_step

__all__ = ["AHLAState", "HLA2State", "HLA3State", "ahla", "ahla_step", "default_backend", "hla2", "hla2_chunked",
           "hla2_step", "hla3", "hla3_step", "hla_masked", "hla_step"]


def default_backend(op: str, dtype: torch.dtype, on_cuda: bool) -> str | None:
    """backend=None's choice: on CUDA the composition for hla3 and where compose16 applies (bf16 hla2), else the
    fused kernels; None (resolve_backend's default) off CUDA and for float64."""
    if not on_cuda or dtype == torch.float64:
        return None
    return "triton" if op == "hla3" or compose16(op, dtype) else "fused"


@autocast_off
def _hla(op, q, k, v, g, decay, normalize, eps, scale, initial_state, output_final_state, cu_seqlens, backend):
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{op}: q must be a torch.Tensor, got {type(q).__name__}")
    if backend is None:
        backend = default_backend(op, q.dtype, q.is_cuda)
    fused = backend == "fused"
    if fused and op == "hla3":
        raise ValueError(f"{op}: backend='fused' exists for hla2 and ahla only; use 'triton' (the composition)")
    backend = resolve_backend(op, "triton" if fused else backend, q.device)
    n = check_recurrent_inputs(op, q, k, v, g=g, cu_seqlens=cu_seqlens, backend=backend)
    decay_powers(op, decay)
    if not eps > 0:
        raise ValueError(f"{op}: eps must be > 0, got {eps}")
    dvs = v.shape[-1] + (1 if normalize else 0)
    if normalize and dvs > 256:
        raise ValueError(f"{op}: normalize=True needs V <= 255 (the denominator is an extra value column)")
    if initial_state is not None:
        check_state(op, initial_state, n, q.shape[2], q.shape[3], dvs, q.device, normalize)
    args = (op, q, k, v, g, decay, normalize, float(eps), float(scale), initial_state, output_final_state,
            cu_seqlens)
    if backend == "naive":
        return hla_recurrent(*args)
    if fused:
        from .triton_fused import hla_fused

        return hla_fused(*args)
    return hla_compose(*args, backend)


@keyword_gates("g")
def hla2(q, k, v, *, g=None, decay="d1", normalize=False, eps=1e-6, scale=1.0, initial_state=None,
         output_final_state=False, cu_seqlens=None, backend=None):
    """Masked second-order HLA; returns (o [B, T, H, V] in q's dtype, HLA2State or None).

    q, k [B, T, H, K], v [B, T, H, V] (fp32/fp16/bf16, one dtype; float64 off "triton"); g [B, T, H] fp32 log
    decays (<= 0) or None for no decay; decay "d1" (default: the mask sits on A = q k^T; passes
    LA(Q, LA(Q, K, K; 2g), V; g)) or "d2" (LA(Q, LA(Q, K, K; g), V; 2g)). normalize=True returns
    numerator / (sign(den) max(|den|, eps)) with den the operator on a value of ones (meaningful with
    non-negative feature maps only). initial_state / final state: HLA2State(S [N, H, K, K], F [N, H, K, V]) fp32
    (F has V + 1 columns with normalize=True, the last the denominator's); N = B, or len(cu_seqlens) - 1 for
    documents packed in B == 1 (nothing crosses a boundary). Gradients flow to q, k, v, g and initial_state.
    backend: None, "torch", "triton", "fused" (the chunked Triton kernels) or "naive" (see the module docstring).
    """
    return _hla("hla2", q, k, v, g, decay, normalize, eps, scale, initial_state, output_final_state, cu_seqlens,
                backend)


@keyword_gates("g")
def ahla(q, k, v, *, g=None, decay="d1", normalize=False, eps=1e-6, scale=1.0, initial_state=None,
         output_final_state=False, cu_seqlens=None, backend=None):
    """Asymmetric HLA, the masked Q (K^T Q)(K^T V); returns (o [B, T, H, V], AHLAState or None).

    Passes LA(Q, K, LA(Q, K, V; g); g). Arguments as for hla2 (decay "d1" only). State
    AHLAState(P [N, H, K, V], E [N, H, K, V]) fp32 (V + 1 columns each with normalize=True). backend as for hla2.
    """
    return _hla("ahla", q, k, v, g, decay, normalize, eps, scale, initial_state, output_final_state, cu_seqlens,
                backend)


@keyword_gates("g")
def hla3(q, k, v, *, g=None, decay="d1", normalize=False, eps=1e-6, scale=1.0, initial_state=None,
         output_final_state=False, cu_seqlens=None, backend=None):
    """Masked third-order HLA [((W W^T) * L) W * L] V, W = D * (Q K^T); returns (o [B, T, H, V], HLA3State or None).

    Passes LA(Q, LA(Q, K, K; 2g), LA(Q, K, V; g); g). Arguments as for hla2 (decay "d1" only). State
    HLA3State(S [N, H, K, K], P [N, H, K, V], F [N, H, K, V]) fp32 (P, F: V + 1 columns with normalize=True).
    """
    return _hla("hla3", q, k, v, g, decay, normalize, eps, scale, initial_state, output_final_state, cu_seqlens,
                backend)
