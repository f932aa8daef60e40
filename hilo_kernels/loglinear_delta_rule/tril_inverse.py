"""T = (I + A)^{-1} for a batch of strictly lower-triangular 64 x 64 matrices A: the WY/UT form's inverse.

chunk.delta_wy_pieces needs X = (I + A)^{-1} diag(beta) for every chunk. As a batched triangular solve
(torch.linalg.solve_triangular) that is a cuBLAS trsm over tens of thousands of 64 x 64 systems in the forward and
two more in autograd's backward. Here the forward is one Triton program per matrix, the blocked forward
substitution of the delta rule's prepare kernel (hilo_kernels.delta_rule.triton_fwd: the four 16 x 16 diagonal blocks by
substitution, the others by products), in fp32 with "ieee" dots; and the backward needs no solve at all, only T:

    T = L^{-1}, L = I + A   =>   dL = -T^T dT T^T,   dA = strict_lower(dL)

(the entries of A above and on the diagonal are not free: A is strictly lower by construction).
`unit_lower_inverse(a, backend)`: backend "triton" (CUDA tensors; CPU ones under TRITON_INTERPRET=1) or "torch"
(solve_triangular against the identity, the same backward). C must be 64 (the chunk) for "triton".
"""

import torch
import triton
import triton.language as tl

from hilo_kernels.delta_rule.triton_fwd import _dot3, _inv_diag_blocks, _load_block, _store_block

C_TRITON = 64


@triton.jit
def _unit_lower_inverse_kernel(a_ptr, t_ptr, C: tl.constexpr):
    """Program i: t[i] = (I + a[i])^{-1}, a[i] strictly lower [C, C] row-major, t[i] zero-initialised."""
    pid = tl.program_id(0).to(tl.int64)
    base = a_ptr + pid * C * C
    r16 = tl.arange(0, 16)
    blk = base + r16[:, None] * C + r16[None, :]
    a10 = _load_block(blk, r16, C, 1, 0, 1, C)
    a20 = _load_block(blk, r16, C, 2, 0, 1, C)
    a21 = _load_block(blk, r16, C, 2, 1, 1, C)
    a30 = _load_block(blk, r16, C, 3, 0, 1, C)
    a31 = _load_block(blk, r16, C, 3, 1, 1, C)
    a32 = _load_block(blk, r16, C, 3, 2, 1, C)
    t00, t11, t22, t33 = _inv_diag_blocks(blk, base, r16, C, 1, C)
    # T_ij = -T_ii sum_{j<=m<i} A_im T_mj
    t10 = -_dot3(t11, a10, t00, "ieee")
    t21 = -_dot3(t22, a21, t11, "ieee")
    t32 = -_dot3(t33, a32, t22, "ieee")
    t20 = -tl.dot(t22, tl.dot(a20, t00, input_precision="ieee") + tl.dot(a21, t10, input_precision="ieee"),
                  input_precision="ieee")
    t31 = -tl.dot(t33, tl.dot(a31, t11, input_precision="ieee") + tl.dot(a32, t21, input_precision="ieee"),
                  input_precision="ieee")
    t30 = -tl.dot(t33, tl.dot(a30, t00, input_precision="ieee") + tl.dot(a31, t10, input_precision="ieee")
                  + tl.dot(a32, t20, input_precision="ieee"), input_precision="ieee")
    out = t_ptr + pid * C * C + r16[:, None] * C + r16[None, :]
    _store_block(out, r16, C, 0, 0, t00, 1, C)
    _store_block(out, r16, C, 1, 0, t10, 1, C)
    _store_block(out, r16, C, 1, 1, t11, 1, C)
    _store_block(out, r16, C, 2, 0, t20, 1, C)
    _store_block(out, r16, C, 2, 1, t21, 1, C)
    _store_block(out, r16, C, 2, 2, t22, 1, C)
    _store_block(out, r16, C, 3, 0, t30, 1, C)
    _store_block(out, r16, C, 3, 1, t31, 1, C)
    _store_block(out, r16, C, 3, 2, t32, 1, C)
    _store_block(out, r16, C, 3, 3, t33, 1, C)


def _inverse_triton(a: torch.Tensor) -> torch.Tensor:
    flat = a.reshape(-1, C_TRITON, C_TRITON).float().contiguous()
    t = torch.zeros_like(flat)
    if flat.shape[0]:
        _unit_lower_inverse_kernel[(flat.shape[0],)](flat, t, C=C_TRITON, num_warps=4)
    return t.reshape(a.shape).to(a.dtype)


def _inverse_torch(a: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)


class _UnitLowerInverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, backend):
        t = _inverse_triton(a) if backend == "triton" else _inverse_torch(a)
        ctx.save_for_backward(t)
        return t

    @staticmethod
    def backward(ctx, dt):
        (t,) = ctx.saved_tensors
        tt = t.transpose(-1, -2)
        return torch.tril(-(tt @ dt @ tt), diagonal=-1), None


def unit_lower_inverse(a: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """(I + a)^{-1} for a [..., C, C] strictly lower-triangular (entries on and above the diagonal are ignored by
    the forward and get no gradient); differentiable. backend "triton" needs C == 64 and fp32 or wider is kept
    (the kernel computes in fp32)."""
    if a.shape[-1] != a.shape[-2]:
        raise ValueError(f"unit_lower_inverse: a must be [..., C, C], got {tuple(a.shape)}")
    if backend == "triton":
        if a.shape[-1] != C_TRITON:
            raise ValueError(f"unit_lower_inverse: the Triton kernel takes C = {C_TRITON}, got {a.shape[-1]}")
        if a.dtype == torch.float64:
            backend = "torch"  # float64 checks keep the exact solve
    elif backend != "torch":
        raise ValueError(f"unit_lower_inverse: backend must be 'triton' or 'torch', got {backend!r}")
    return _UnitLowerInverse.apply(torch.tril(a, diagonal=-1), backend)
