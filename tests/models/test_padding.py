"""Padded batches (models/padding.py, docs/design.md): for every model family, a batch of rows of different lengths
padded left or right gives, at its real tokens, the logits of each row run alone, and greedy generate() of a
left-padded batch gives each row's own tokens (the prefill runs packed; the cached steps read per-row states and
key-masked KV caches)."""

from pathlib import Path

import pytest
import torch
import yaml

from models import build_model
from tests.models.family_checks import perturb

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"
VOCAB = 61
BASE = {"vocab_size": VOCAB, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "max_position_embeddings": 64}
MAMBA = {"head_dim": 16, "state_size": 8}
GDN = {"head_dim": 16, "num_heads": 2, "expand_v": 2}
# one tiny model per conf/model preset (named as the preset), plus hybrids and the shells' options that carry state
# or positions of their own (HLA's short convs, decay and normaliser; the pre-mixer conv; GQA)
FAMILIES = {
    "transformer": {"mixer": "attention", "num_kv_heads": 1},
    "mamba2": {"mixer": "mamba2", "mixer_kwargs": MAMBA},
    "gated_deltanet": {"mixer": "gated_deltanet", "mixer_kwargs": GDN},
    "loglinear_mamba2": {"mixer": "loglinear_mamba2", "mixer_kwargs": MAMBA},
    "loglinear_gated_deltanet": {"mixer": "loglinear_gated_deltanet", "mixer_kwargs": GDN},
    "hla_transformer": {"mixer": "attention", "operator": "hla2", "num_kv_heads": 1,
                        "mixer_kwargs": {"decay": True, "conv_size": 3}},
    "ahla_transformer": {"mixer": "attention", "operator": "ahla"},
    "hla3_transformer": {"mixer": "attention", "operator": "hla3", "mixer_kwargs": {"normalize": True}},
    "hla_mamba2": {"mixer": "mamba2", "operator": "hla2", "mixer_kwargs": MAMBA},
    "hla_gated_deltanet": {"mixer": "gated_deltanet", "operator": "ahla", "mixer_kwargs": GDN},
    "hybrid_mamba2": {"mixer": "mamba2", "attn_layers": [1], "pre_conv": 4, "mixer_kwargs": MAMBA},
    "hybrid_loglinear_gdn": {"mixer": "loglinear_gated_deltanet", "attn_layers": [0], "mixer_kwargs": GDN},
}
LENGTHS = (7, 4, 1)  # 1 and 4 are no longer than the short convs' window
NEW_TOKENS = 4


def tiny(family: str):
    torch.manual_seed(0)
    model = build_model({**BASE, **FAMILIES[family]}).eval()
    perturb(model, spread_levels=True)  # norms, decays and levels off their init: the rows' outputs differ more
    return model


def rows(seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in LENGTHS]


def padded(seqs: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor, list[slice]]:
    """(ids [B, T] with pad id 0, attention_mask [B, T], each row's slice of real tokens)."""
    t = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    where = []
    for i, s in enumerate(seqs):
        cols = slice(t - len(s), t) if side == "left" else slice(0, len(s))
        ids[i, cols], mask[i, cols] = s, 1
        where.append(cols)
    return ids, mask, where


def error_ratio(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).square().mean().sqrt() / ref.square().mean().sqrt())


def test_every_preset_family_is_covered():
    presets = {yaml.safe_load(p.read_text())["name"] for p in CONF.glob("*.yaml")}
    assert presets <= set(FAMILIES), f"conf/model presets without a padding test: {sorted(presets - set(FAMILIES))}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_padded_batch_equals_rows_alone(family):
    """Logits at the real tokens of a left- and a right-padded batch, and of a left-padded prefill continued through
    the cache by a chunk of 2 tokens and a single token, equal those of each row alone (error ratio <= 1e-5);
    greedy generate() of the left-padded batch gives each row's own greedy tokens."""
    model = tiny(family)
    seqs = rows()
    more = torch.randint(1, VOCAB, (len(seqs), 3), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        # each row alone, over its prompt and the 3 tokens that continue it
        alone = [model(torch.cat([s, m])[None], use_cache=False).logits[0] for s, m in zip(seqs, more)]
        for side in ("left", "right"):
            ids, mask, where = padded(seqs, side)
            logits = model(ids, attention_mask=mask, use_cache=False).logits
            for i, cols in enumerate(where):
                assert error_ratio(logits[i, cols], alone[i][:len(seqs[i])]) <= 1e-5, (side, i)
        # the cached path: a left-padded prefill, then 2 tokens, then 1, each forward with the mask so far
        ids, mask, _ = padded(seqs, "left")
        out = model(ids, attention_mask=mask, use_cache=True)
        steps = []
        for cols in (slice(0, 2), slice(2, 3)):
            mask = torch.cat([mask, torch.ones_like(more[:, cols])], 1)
            out = model(more[:, cols], attention_mask=mask, cache=out.past_key_values, use_cache=True)
            steps.append(out.logits)
        for i, s in enumerate(seqs):
            assert error_ratio(torch.cat(steps, 1)[i], alone[i][len(s):]) <= 1e-5, i
        # generation: left padding (what HF generation uses for decoder-only models), through the cached steps
        ids, mask, _ = padded(seqs, "left")
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                   pad_token_id=0)
        for i, s in enumerate(seqs):
            own = model.generate(s[None], attention_mask=torch.ones(1, len(s), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            assert torch.equal(generated[i, ids.shape[1]:], own[0, len(s):]), i


@pytest.mark.parametrize("family", ["transformer", "hybrid_mamba2"])
def test_all_ones_mask_is_the_plain_forward(family, monkeypatch):
    """A mask of ones never unpads: the same logits, bit for bit, as no mask (prefill and a cached step)."""
    import models.lm

    def refuse(mask):
        raise AssertionError("an all-ones mask was unpadded")

    monkeypatch.setattr(models.lm, "unpad_mask", refuse)
    model = tiny(family)
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = model(ids, use_cache=True)
        masked = model(ids, attention_mask=torch.ones_like(ids), use_cache=True)
        assert torch.equal(plain.logits, masked.logits)
        nxt = ids[:, :1]
        step_plain = model(nxt, cache=plain.past_key_values, use_cache=True).logits
        step_masked = model(nxt, attention_mask=torch.ones(2, 7, dtype=torch.long), cache=masked.past_key_values,
                            use_cache=True).logits
    assert torch.equal(step_plain, step_masked)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_loss_is_the_packed_rows_loss(side):
    """labels of a padded batch: pads and each row's first token are no targets, so the loss is the packed rows'
    (cu_seqlens), and its gradients as well."""
    model = tiny("hybrid_mamba2")
    seqs = rows()
    ids, mask, _ = padded(seqs, side)
    loss = model(ids, attention_mask=mask, labels=ids).loss
    packed = torch.cat(seqs)[None]
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    ref = model(packed, cu_seqlens=cu, labels=packed).loss
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)


def test_compiled_decoding_of_padded_rows():
    """compile_decoding's steps (aot_eager: dynamo's capture without code generation) over a left-padded batch give
    the eager tokens, across the KV buffers' doubling at 64 tokens (the padding mask beside them grows too)."""
    model = tiny("hybrid_loglinear_gdn")  # softmax attention and a log-linear layer
    g = torch.Generator().manual_seed(4)
    ids, mask, _ = padded([torch.randint(1, VOCAB, (n,), generator=g) for n in (60, 33, 2)], "left")
    kwargs = {"attention_mask": mask, "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        eager = model.generate(ids, **kwargs)
        torch._dynamo.reset()
        model.compile_decoding(backend="aot_eager")
        try:
            compiled = model.generate(ids, **kwargs)
        finally:
            model.compile_decoding(enabled=False)
    assert torch.equal(compiled, eager)
