"""Chunked cross-entropy through the LM head that never holds the logits of all rows at once.

chunked_cross_entropy(hidden, weight, targets) equals F.cross_entropy((hidden @ weight.T).float(), targets,
ignore_index=-100, reduction=...) with its gradients w.r.t. hidden and weight, but walks the rows in chunks: per
chunk it forms the chunk's logits, their log-softmax in fp32 (or wider), the loss terms and, when gradients are
needed, d loss / d logits, which it folds at once into the chunk's rows of grad_hidden and into an fp32 grad_weight
accumulator. The forward therefore does the whole backward work; backward only scales the two saved gradients by
grad_output. Peak extra memory is O(chunk_size * V) instead of O(N * V).
"""

import torch
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax and accumulation dtype: fp32 for half inputs, the input dtype when it is wider (float64 tests)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_terms(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, want_grad: bool):
    """Loss terms [n] (0 at ignored rows) of one chunk and, when want_grad, d(sum of terms) / d logits [n, V]
    (softmax - one_hot, zero rows where ignored) in the compute dtype."""
    logits = (hidden @ weight.t()).to(_compute_dtype(hidden.dtype))
    keep = targets != IGNORE_INDEX
    safe = torch.where(keep, targets, torch.zeros_like(targets)).unsqueeze(1)
    picked = logits.gather(1, safe).squeeze(1)
    # softmax in place: the chunk's logits are the only [n, V] buffer (besides the matmul's own output in half
    # precision)
    row_max = logits.amax(dim=1, keepdim=True)
    probs = logits.sub_(row_max).exp_()
    total = probs.sum(dim=1, keepdim=True)
    terms = (row_max + total.log()).squeeze(1) - picked
    terms = torch.where(keep, terms, torch.zeros_like(terms))
    if not want_grad:
        return terms, None
    probs.div_(total)
    probs.scatter_add_(1, safe, -torch.ones_like(safe, dtype=probs.dtype))
    probs.mul_(keep.unsqueeze(1).to(probs.dtype))
    return terms, probs


def _check(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int, reduction: str):
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, C] and weight [V, C] expected, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets [N] expected for hidden {tuple(hidden.shape)}, got {tuple(targets.shape)}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")


def _reduce(total: torch.Tensor, targets: torch.Tensor, reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, gradient scale): the sum, or the mean over the kept targets (nan when none is kept, as
    F.cross_entropy; the gradients are then 0, as F.cross_entropy's)."""
    if reduction == "sum":
        return total, torch.ones_like(total)
    count = (targets != IGNORE_INDEX).sum().to(total.dtype)
    return total / count, 1.0 / count.clamp(min=1)


class ChunkedCrossEntropy(torch.autograd.Function):
    """autograd.Function behind chunked_cross_entropy (see there); not twice differentiable."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, reduction):
        n = hidden.shape[0]
        acc = _compute_dtype(hidden.dtype)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for start in range(0, n, chunk_size):
            h, t = hidden[start:start + chunk_size], targets[start:start + chunk_size]
            terms, grad_logits = _chunk_terms(h, weight, t, need_hidden or need_weight)
            total = total + terms.sum()
            if grad_logits is None:
                continue
            grad_logits = grad_logits.to(hidden.dtype)
            if need_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[start:start + chunk_size])
            if need_weight:
                grad_weight.add_(grad_logits.t() @ h)
        loss, scale = _reduce(total, targets, reduction)
        ctx.save_for_backward(grad_hidden, grad_weight, scale)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        grad_hidden, grad_weight, scale = ctx.saved_tensors
        factor = grad_output.to(scale.dtype) * scale
        if grad_hidden is not None:
            grad_hidden = grad_hidden * factor.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * factor).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int = 4096,
    reduction: str = "sum",
) -> torch.Tensor:
    """Cross-entropy of logits = hidden @ weight.T against targets, chunk_size rows at a time.

    hidden [N, C] and weight [V, C] (a bias-free LM head; tied or not, its gradient reaches the shared Parameter)
    share a float dtype; targets [N] are class indices with -100 ignored (others outside [0, V) are not checked).
    The logits are formed in the input dtype (under autocast: the autocast dtype, as nn.Linear would), the
    log-softmax, loss and gradient accumulation run in fp32 (float64 for float64 inputs).
    reduction "sum": sum over kept targets; "mean": that sum / the number of kept targets (nan when none is kept,
    with zero gradients, as F.cross_entropy). Returns a 0-dim fp32 tensor (float64 for float64 inputs).

    With gradients enabled, the forward also computes grad_hidden [N, C] and an fp32 grad_weight [V, C] and keeps
    only those; without, it computes the loss alone. Neither ever holds more than chunk_size rows of logits.
    """
    _check(hidden, weight, targets, chunk_size, reduction)
    targets = targets.to(hidden.device)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must share a dtype, got {hidden.dtype} and {weight.dtype}")
    with torch.autocast(device_type, enabled=False):
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return ChunkedCrossEntropy.apply(hidden, weight, targets, chunk_size, reduction)
        acc = _compute_dtype(hidden.dtype)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            terms, _ = _chunk_terms(hidden[start:start + chunk_size], weight, targets[start:start + chunk_size],
                                    False)
            total = total + terms.sum()
        return _reduce(total, targets, reduction)[0]
