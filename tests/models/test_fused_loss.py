"""models.loss.chunked_cross_entropy against F.cross_entropy on full logits, and HiloForCausalLM's fused loss path
against its plain one (CPU)."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from models import HiloConfig, build_model
from models.loss import chunked_cross_entropy

N, C, V = 53, 24, 37  # N not a multiple of any chunk size used, V odd


def inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, C, generator=g, dtype=dtype)
    weight = (torch.randn(V, C, generator=g) / C**0.5).to(dtype)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[[0, 7, 30, 52]] = -100
    targets[10:25] = -100  # with chunk_size 5 or 8 this covers whole chunks
    return hidden.requires_grad_(), weight.requires_grad_(), targets


def reference(hidden, weight, targets, reduction):
    return F.cross_entropy((hidden @ weight.t()).double(), targets, ignore_index=-100, reduction=reduction)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("chunk_size", [1, 5, 8, N, 1000])
def test_values_and_grads_equal_cross_entropy_on_full_logits(reduction, chunk_size):
    hidden, weight, targets = inputs()
    upstream = 0.37  # backward must scale the gradients saved in forward by grad_output
    got = chunked_cross_entropy(hidden, weight, targets, chunk_size=chunk_size, reduction=reduction)
    got_grads = torch.autograd.grad(got * upstream, (hidden, weight))
    want = reference(hidden, weight, targets, reduction)
    want_grads = torch.autograd.grad(want * upstream, (hidden, weight))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-10)


def test_fp32_and_no_grad_and_single_input_grads():
    hidden, weight, targets = inputs(torch.float32, seed=1)
    want = reference(hidden, weight, targets, "mean")
    want_h, want_w = torch.autograd.grad(want, (hidden, weight))
    got = chunked_cross_entropy(hidden, weight, targets, chunk_size=6, reduction="mean")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(chunked_cross_entropy(hidden, weight, targets, chunk_size=6, reduction="mean"),
                                   got.detach())
    # a frozen head (or frozen hidden) still gets the other gradient right
    (g_h,) = torch.autograd.grad(chunked_cross_entropy(hidden, weight.detach(), targets, chunk_size=6,
                                                       reduction="mean"), hidden)
    (g_w,) = torch.autograd.grad(chunked_cross_entropy(hidden.detach(), weight, targets, chunk_size=6,
                                                       reduction="mean"), weight)
    torch.testing.assert_close(g_h.double(), want_h.double(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(g_w.double(), want_w.double(), atol=1e-6, rtol=1e-5)


def test_all_targets_ignored_matches_cross_entropy():
    hidden, weight, _ = inputs()
    targets = torch.full((N,), -100)
    total = chunked_cross_entropy(hidden, weight, targets, chunk_size=8, reduction="sum")
    assert total.item() == 0.0
    mean = chunked_cross_entropy(hidden, weight, targets, chunk_size=8, reduction="mean")
    assert torch.isnan(mean) and torch.isnan(reference(hidden, weight, targets, "mean"))
    for g in torch.autograd.grad(mean, (hidden, weight)):
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_close_to_fp32_reference(dtype):
    hidden, weight, targets = inputs(dtype, seed=2)
    got = chunked_cross_entropy(hidden, weight, targets, chunk_size=8, reduction="mean")
    g_h, g_w = torch.autograd.grad(got, (hidden, weight))
    assert got.dtype == torch.float32 and g_h.dtype == dtype and g_w.dtype == dtype
    h32, w32 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    want = reference(h32, w32, targets, "mean")
    want_h, want_w = torch.autograd.grad(want, (h32, w32))
    # the logits are rounded to the half dtype, as the unfused head's would be; the softmax is not
    assert abs(got.item() - want.item()) < 2e-2 * want.item()
    for g, w in [(g_h, want_h), (g_w, want_w)]:
        assert (g.double() - w).norm() < 3e-2 * w.norm()


def test_autocast_forms_the_logits_in_the_autocast_dtype():
    hidden, weight, targets = inputs(torch.float32, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunked_cross_entropy(hidden, weight, targets, chunk_size=8, reduction="sum")
        want = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")
    g_h, g_w = torch.autograd.grad(got, (hidden, weight))
    want_h, want_w = torch.autograd.grad(want, (hidden, weight))
    assert got.dtype == torch.float32 and g_w.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)  # the same bf16 logits, different sum order
    for g, w in [(g_h, want_h), (g_w, want_w)]:
        assert (g - w).norm() < 1e-2 * w.norm()


class LargestTensor(TorchDispatchMode):
    """Records the largest numel of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_larger_than_a_chunk_of_logits_is_formed_or_saved():
    n, c, chunk = 201, 6, 4
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(n, c, generator=g).requires_grad_()
    weight = torch.randn(V, c, generator=g).requires_grad_()
    targets = torch.randint(0, V, (n,), generator=g)
    bound = max(chunk * V, n * c, V * c)  # a chunk's logits, grad_hidden, grad_weight
    assert n * V > 4 * bound
    with LargestTensor() as plain:
        reference(hidden, weight, targets, "sum").backward()
    assert plain.largest >= n * V  # the probe sees the full logits of the plain path
    saved = []
    with LargestTensor() as fused, torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                                             lambda t: t):
        loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=chunk)
        loss.backward()
    assert fused.largest <= bound
    assert saved and all(t.numel() <= bound for t in saved)


# ---- HiloForCausalLM: fused path (return_logits=False) against the plain one

VOCAB = 101
TINY = {"vocab_size": VOCAB, "hidden_size": 64, "num_layers": 2, "num_heads": 4}


def model_pair(chunk, **overrides):
    torch.manual_seed(0)
    model = build_model({**TINY, "fused_loss_chunk": chunk, **overrides}).train()
    return model


def loss_and_grads(model, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("num_items", [None, 40])
def test_model_fused_loss_equals_plain_loss_with_all_grads(tie, num_items):
    model = model_pair(7, tie_word_embeddings=tie)
    lengths = [9, 1, 14, 6]  # packed documents; 30 tokens, 4 rows of 7 + 2
    x = torch.randint(0, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(5))
    labels = x.clone()
    labels[0, 20:27] = -100  # a whole chunk of targets (positions 19..25) ignored, across a document start
    cu = torch.tensor([0, 9, 10, 24, 30])
    kwargs = {"input_ids": x, "labels": labels, "cu_seqlens": cu, "num_items_in_batch": num_items}
    plain, plain_grads = loss_and_grads(model, **kwargs)
    fused, fused_grads = loss_and_grads(model, return_logits=False, **kwargs)
    assert plain.logits.shape == (1, 30, VOCAB) and fused.logits is None
    torch.testing.assert_close(fused.loss, plain.loss, atol=1e-6, rtol=1e-6)
    assert plain_grads.keys() == fused_grads.keys()
    for name in plain_grads:
        torch.testing.assert_close(fused_grads[name], plain_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    # the document starts really are excluded: without cu_seqlens the loss differs
    unmasked = model(input_ids=x, labels=labels, return_logits=False).loss
    assert abs(unmasked.item() - fused.loss.item()) > 1e-4


def test_model_fused_loss_rows_and_eval():
    model = model_pair(5).eval()
    x = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(6))
    labels = x.clone()
    labels[1] = -100
    labels[2, :4] = -100
    with torch.no_grad():
        plain = model(x, labels=labels).loss
        fused = model(x, labels=labels, return_logits=False)
    assert fused.logits is None
    torch.testing.assert_close(fused.loss, plain, atol=1e-6, rtol=1e-6)
    # logits without labels, and fused_loss_chunk=None, are unchanged
    off = model_pair(None).eval()
    with torch.no_grad():
        out = off(x, labels=labels, return_logits=False)
        assert out.logits is None
        torch.testing.assert_close(out.loss, plain)
        torch.testing.assert_close(model(x).logits, off(x).logits)


def test_config_default_and_validation():
    assert HiloConfig().fused_loss_chunk == 4096
    for bad in [0, -3, 2.5, True, "4096"]:
        with pytest.raises(ValueError, match="fused_loss_chunk"):
            HiloConfig(fused_loss_chunk=bad)


@pytest.mark.parametrize("num_items", [None, 3])
def test_loss_at_targets_only_equals_plain_loss_on_fewer_rows(num_items, monkeypatch):
    model = model_pair(4, loss_at_targets_only=True)
    x = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(7))
    labels = torch.full_like(x, -100)
    labels[0, 5], labels[1, 2], labels[1, 12] = 3, 7, 11  # three targets, as MQAR's queries
    kwargs = {"input_ids": x, "labels": labels, "num_items_in_batch": num_items}
    plain, plain_grads = loss_and_grads(model, **kwargs)
    from models import lm
    head_rows = []
    real = lm.chunked_cross_entropy
    monkeypatch.setattr(lm, "chunked_cross_entropy", lambda h, *a, **k: head_rows.append(len(h)) or real(h, *a, **k))
    sparse, sparse_grads = loss_and_grads(model, return_logits=False, **kwargs)
    assert head_rows == [3]  # the head ran on the three target rows, not on 2 x 13
    torch.testing.assert_close(sparse.loss, plain.loss, atol=1e-6, rtol=1e-6)
    for name in plain_grads:
        torch.testing.assert_close(sparse_grads[name], plain_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    with pytest.raises(TypeError, match="loss_at_targets_only"):
        HiloConfig(loss_at_targets_only=1)
