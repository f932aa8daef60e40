"""hilo_kernels.softmax_attn: sdpa against the fp32 naive oracle, and an independent per-query loop for the oracle."""

import itertools
import math

import pytest
import torch

from hilo_kernels import softmax_attn


def err_ratio(out: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS(out - ref) / RMS(ref), as fla measures kernels."""
    out, ref = out.double(), ref.double()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def make(b, tq, tk, h, hkv, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, tq, h, d, generator=g, dtype=dtype)
    k = torch.randn(b, tk, hkv, d, generator=g, dtype=dtype)
    v = torch.randn(b, tk, hkv, d, generator=g, dtype=dtype)
    return q, k, v


def loop_reference(q, k, v, causal=True, bounds=None, scale=None):
    """Query-by-query definition in float64, written without masks or batched softmax."""
    b, tq, h, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros(b, tq, h, d, dtype=torch.float64)
    doc_of = None
    if bounds is not None:
        doc_of = [next(n for n in range(len(bounds) - 1) if bounds[n] <= t < bounds[n + 1]) for t in range(tk)]
    for bi in range(b):
        for i in range(tq):
            keys = [j for j in range(tk) if (not causal or j <= tk - tq + i)]
            if doc_of is not None:
                keys = [j for j in keys if doc_of[j] == doc_of[i]]
            for hi in range(h):
                kh = hi // (h // hkv)
                s = torch.stack([(q[bi, i, hi].double() @ k[bi, j, kh].double()) * scale for j in keys])
                p = torch.softmax(s, 0)
                out[bi, i, hi] = sum(p[n] * v[bi, j, kh].double() for n, j in enumerate(keys))
    return out


@pytest.mark.parametrize("b,t,h,hkv,d", [(2, 17, 4, 4, 16), (1, 9, 6, 2, 60), (2, 5, 3, 1, 100)])
def test_naive_matches_loop_definition(b, t, h, hkv, d):
    q, k, v = make(b, t, t, h, hkv, d, seed=1)
    ref = loop_reference(q, k, v)
    assert err_ratio(softmax_attn(q, k, v, backend="naive"), ref) <= 1e-6


def test_naive_varlen_and_cached_match_loop_definition():
    q, k, v = make(1, 12, 12, 4, 2, 8, seed=2)
    bounds = [0, 1, 8, 12]
    out = softmax_attn(q, k, v, cu_seqlens=torch.tensor(bounds), backend="naive")
    assert err_ratio(out, loop_reference(q, k, v, bounds=bounds)) <= 1e-6
    q, k, v = make(2, 3, 10, 4, 2, 8, seed=3)
    assert err_ratio(softmax_attn(q, k, v, backend="naive"), loop_reference(q, k, v)) <= 1e-6


@pytest.mark.parametrize(
    "b,t,h,hkv,d",
    [(2, 63, 4, 4, 32), (1, 75, 8, 2, 60), (2, 33, 6, 3, 100), (1, 1, 2, 1, 64), (3, 128, 4, 1, 16)],
)
def test_sdpa_matches_naive_causal_and_gqa(b, t, h, hkv, d):
    q, k, v = make(b, t, t, h, hkv, d, seed=t)
    ref = softmax_attn(q, k, v, backend="naive")
    assert err_ratio(softmax_attn(q, k, v, backend="sdpa"), ref) <= 1e-4
    assert err_ratio(softmax_attn(q, k, v), ref) <= 1e-4  # default backend on CPU


def test_non_causal_and_custom_scale():
    q, k, v = make(2, 21, 21, 4, 2, 24, seed=5)
    ref = loop_reference(q, k, v, causal=False, scale=0.3)
    for backend in ("naive", "sdpa"):
        assert err_ratio(softmax_attn(q, k, v, causal=False, scale=0.3, backend=backend), ref) <= 1e-4
    # causal must differ from non-causal: the mask is really applied
    assert err_ratio(softmax_attn(q, k, v, scale=0.3, backend="sdpa"), ref) > 1e-2


def test_varlen_equals_per_document_runs():
    lengths = [1, 15, 40, 7, 1, 23]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    t = bounds[-1]
    q, k, v = make(1, t, t, 6, 2, 60, seed=7)
    cu = torch.tensor(bounds)
    per_doc = torch.cat(
        [softmax_attn(q[:, a:b], k[:, a:b], v[:, a:b], backend="naive") for a, b in itertools.pairwise(bounds)],
        dim=1,
    )
    for backend in ("naive", "sdpa"):
        out = softmax_attn(q, k, v, cu_seqlens=cu, backend=backend)
        assert err_ratio(out, per_doc) <= 1e-4
    # without cu_seqlens the documents would see each other: the packed result must differ
    assert err_ratio(softmax_attn(q, k, v, backend="sdpa"), per_doc) > 1e-2


def test_varlen_no_leak_across_documents():
    """Changing one document's keys/values leaves every other document's output unchanged."""
    bounds = [0, 15, 16, 30]
    q, k, v = make(1, 30, 30, 4, 4, 16, seed=8)
    cu = torch.tensor(bounds, dtype=torch.int32)
    out = softmax_attn(q, k, v, cu_seqlens=cu, backend="sdpa")
    k2, v2 = k.clone(), v.clone()
    k2[:, 16:] += 3.0
    v2[:, 16:] -= 5.0
    out2 = softmax_attn(q, k2, v2, cu_seqlens=cu, backend="sdpa")
    assert torch.equal(out[:, :16], out2[:, :16])
    assert not torch.allclose(out[:, 16:], out2[:, 16:])


@pytest.mark.parametrize("tq,tk", [(1, 20), (4, 20), (7, 7 + 13)])
def test_cached_queries_align_bottom_right(tq, tk):
    """Tq < Tk: the Tq queries are the last Tq positions of a length-Tk causal sequence."""
    q_full, k, v = make(2, tk, tk, 4, 2, 32, seed=tq)
    full = softmax_attn(q_full, k, v, backend="naive")
    q = q_full[:, tk - tq:]
    for backend in ("naive", "sdpa"):
        assert err_ratio(softmax_attn(q, k, v, backend=backend), full[:, tk - tq:]) <= 1e-4


@pytest.mark.parametrize("tq,causal", [(1, True), (3, False)])
def test_key_mask_reads_the_filled_prefix_of_a_buffer(tq, causal):
    """key_mask (a preallocated KV cache, HiloCache.write_kv_step): attention over a 32-slot buffer whose first 21
    slots hold keys equals attention over those 21 keys, whatever the other slots hold."""
    q, k, v = make(2, tq, 21, 4, 2, 16, seed=12)
    ref = loop_reference(q, k, v, causal=causal)
    k_buf, v_buf = (torch.cat([t, 50.0 * torch.randn(2, 11, 2, 16)], dim=1) for t in (k, v))
    visible = torch.arange(32) < 21
    for backend in ("naive", "sdpa", None):
        out = softmax_attn(q, k_buf, v_buf, causal=causal, key_mask=visible, backend=backend)
        assert err_ratio(out, ref) <= 1e-5, backend
    # the mask matters: without it the queries see the other slots
    assert err_ratio(softmax_attn(q, k_buf, v_buf, causal=causal, backend="sdpa"), ref) > 1e-2


@pytest.mark.parametrize("tq", [1, 3, 5])
def test_per_row_key_mask_leaves_out_each_rows_padding(tq):
    """key_mask [B, Tk] (a padded batch's KV cache): row b's queries attend causally (bottom-right) to its keys
    after its p_b left pads only, as if the row held those keys alone, whatever the pads hold."""
    q, k, v = make(2, tq, 8, 4, 2, 16, seed=13)
    pads = (0, 3)
    keep = torch.arange(8)[None, :] >= torch.tensor(pads)[:, None]
    k, v = (torch.where(keep[:, :, None, None], t, 50.0 * torch.randn_like(t)) for t in (k, v))
    for backend in ("naive", "sdpa", None):
        out = softmax_attn(q, k, v, causal=True, key_mask=keep, backend=backend)
        for b, p in enumerate(pads):
            ref = loop_reference(q[b:b + 1], k[b:b + 1, p:], v[b:b + 1, p:], causal=True)
            assert err_ratio(out[b:b + 1], ref) <= 1e-5, (backend, b)
    assert err_ratio(softmax_attn(q, k, v, causal=True, backend="sdpa")[1:],
                     loop_reference(q[1:], k[1:, 3:], v[1:, 3:])) > 1e-2  # without the mask, the pads are read


def test_low_precision_inputs_return_their_dtype():
    q, k, v = make(1, 19, 19, 4, 2, 32, seed=9)
    ref = softmax_attn(q, k, v, backend="naive")
    qh, kh, vh = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out = softmax_attn(qh, kh, vh, backend="sdpa")
    assert out.dtype == torch.bfloat16
    assert err_ratio(out.float(), ref) <= 2e-2


def test_gradients_match_naive():
    q, k, v = make(1, 23, 23, 4, 2, 20, seed=10)
    cu = torch.tensor([0, 1, 16, 23])
    grads = {}
    for backend in ("naive", "sdpa"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = softmax_attn(*leaves, cu_seqlens=cu, backend=backend)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads[backend] = [t.grad for t in leaves]
    for g_sdpa, g_naive in zip(grads["sdpa"], grads["naive"]):
        assert err_ratio(g_sdpa, g_naive) <= 1e-4


def test_bad_inputs_raise_clear_errors():
    q, k, v = make(1, 8, 8, 4, 2, 16)
    with pytest.raises(ValueError, match=r"4-D \[B, T, H, D\]"):
        softmax_attn(q[0], k, v)
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        softmax_attn(make(1, 8, 8, 3, 2, 16)[0], k, v)
    with pytest.raises(ValueError, match="same shape"):
        softmax_attn(q, k, v[:, :4])
    with pytest.raises(ValueError, match="D=16"):
        softmax_attn(q, k[..., :8], v[..., :8])
    with pytest.raises(TypeError, match="one dtype"):
        softmax_attn(q, k.double().float().half(), v.half())
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        softmax_attn(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="Tq <= Tk"):
        softmax_attn(make(1, 9, 9, 4, 2, 16)[0], k, v)
    with pytest.raises(ValueError, match="B == 1"):
        qb, kb, vb = make(2, 8, 8, 4, 2, 16)
        softmax_attn(qb, kb, vb, cu_seqlens=torch.tensor([0, 3, 8]))
    with pytest.raises(ValueError, match="from 0 to T=8"):
        softmax_attn(q, k, v, cu_seqlens=torch.tensor([0, 3, 7]))
    with pytest.raises(ValueError, match="from 0 to T=8"):
        softmax_attn(q, k, v, cu_seqlens=torch.tensor([0, 5, 3, 8]))
    with pytest.raises(TypeError, match="1-D int32/int64"):
        softmax_attn(q, k, v, cu_seqlens=torch.tensor([0.0, 8.0]))
    with pytest.raises(ValueError, match=r"key_mask must be a bool tensor \[Tk=8\]"):
        softmax_attn(q[:, :1], k, v, key_mask=torch.ones(8))
    with pytest.raises(ValueError, match=r"key_mask must be a bool tensor \[Tk=8\]"):
        softmax_attn(q[:, :1], k, v, key_mask=torch.ones(7, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"or \[B=1, Tk=8\]"):
        softmax_attn(q, k, v, key_mask=torch.ones(2, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="takes one query"):
        softmax_attn(q, k, v, key_mask=torch.ones(8, dtype=torch.bool))
    with pytest.raises(ValueError, match="cannot be combined with cu_seqlens"):
        softmax_attn(q, k, v, key_mask=torch.ones(8, dtype=torch.bool), cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="key_mask needs backend 'sdpa' or 'naive'"):
        softmax_attn(q[:, :1], k, v, key_mask=torch.ones(8, dtype=torch.bool), backend="flash")
    with pytest.raises(ValueError, match="unknown backend"):
        softmax_attn(q, k, v, backend="cudnn")
    with pytest.raises((RuntimeError, ValueError), match="flash"):
        softmax_attn(q, k, v, backend="flash")  # no flash_attn on CPU CI, or CPU fp32 inputs


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = make(1, 10, 10, 2, 2, 36, seed=11)
    assert err_ratio(softmax_attn(q, k, v), softmax_attn(q, k, v, scale=1 / math.sqrt(36))) == 0.0
