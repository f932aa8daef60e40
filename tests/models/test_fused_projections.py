"""config.fused_projections (models.casts.ProjectionInput.project): the projections that read one layer input as one
matmul of their stacked weights. A tiny model with it on against off: the same parameters (names and values), loss,
every gradient and greedy tokens through the cache, for each mixer that has such projections."""

import pytest
import torch

from models import build_model
from models.casts import ProjectionInput

VOCAB = 61
# (mixer, operator, mixer_kwargs, how many projections one fused call must stack)
CASES = [
    ("attention", None, {}, 3),  # q, k, v
    ("attention", "hla2", {"decay": True, "conv_size": 3}, 5),  # q, k, v, output gate, decay
    ("gated_deltanet", None, {"head_dim": 16}, 6),  # q, k, v, output gate, decay, beta
    ("gated_deltanet", "ahla", {"head_dim": 16}, 5),  # no beta
    ("loglinear_gated_deltanet", None, {"head_dim": 16}, 6),
]


def tiny(mixer, operator, mixer_kwargs, fused, seed=0):
    torch.manual_seed(seed)
    return build_model({"vocab_size": VOCAB, "hidden_size": 48, "num_layers": 2, "num_heads": 4, "mixer": mixer,
                        "operator": operator, "mixer_kwargs": mixer_kwargs, "fused_projections": fused,
                        "max_position_embeddings": 64})


def assert_rel(got, want, tol=1e-5):
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.double() - want.double()).abs().max().item()
    assert err <= tol * max(want.double().abs().max().item(), 1e-30), f"max error {err:.3g}"


@pytest.mark.parametrize("mixer,operator,mixer_kwargs,stacked", CASES)
def test_fused_projections_equal_separate(monkeypatch, mixer, operator, mixer_kwargs, stacked):
    calls = []
    project = ProjectionInput.project

    def recording(self, linears, fused):
        calls.append((len(linears), fused))
        return project(self, linears, fused)

    monkeypatch.setattr(ProjectionInput, "project", recording)
    ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(1))
    results = []
    for fused in (False, True):
        model = tiny(mixer, operator, mixer_kwargs, fused).train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((model, loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (plain, want_loss, want_grads), (fused_model, got_loss, got_grads) = results
    assert (stacked, True) in calls and (stacked, False) in calls  # both paths ran, with every projection
    assert plain.state_dict().keys() == fused_model.state_dict().keys()  # checkpoints are unchanged
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), fused_model.state_dict().values()))
    assert_rel(got_loss, want_loss)
    assert want_grads.keys() == got_grads.keys()
    for name, want in want_grads.items():
        assert_rel(got_grads[name], want)
    prompt = ids[:1, :9]
    calls.clear()
    with torch.no_grad():
        tokens = [m.eval().generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
                  for m in (plain, fused_model)]
    assert torch.equal(tokens[0], tokens[1])
    # without autograd (here: decoding) the fused model's projections run one by one, so no per-token weight copy
    assert any(fused for _, fused in calls)
    with torch.no_grad():
        x = ProjectionInput(torch.randn(1, 3, 48))
        assert [o.is_contiguous() for o in x.project([torch.nn.Linear(48, 5, bias=False)] * 2, True)] == [True, True]


def test_fused_output_rows_are_padded_to_eight_columns():
    """The stacked output has a multiple of 8 columns (zero weight rows appended), so its rows are 16-byte aligned in
    bf16; the outputs are the separate projections' values, and the padding gets no gradient."""
    linears = [torch.nn.Linear(48, n, bias=False) for n in (16, 24, 3, 3)]  # 46 outputs -> 48 columns
    hidden = torch.randn(2, 5, 48, requires_grad=True)
    outs = ProjectionInput(hidden).project(linears, True)
    assert [o.shape[-1] for o in outs] == [16, 24, 3, 3] and all(o.stride(1) == 48 for o in outs)
    for o, linear in zip(outs, linears, strict=True):
        assert torch.allclose(o, linear(hidden), atol=1e-6)
    sum(o.square().sum() for o in outs).backward()
    assert all(linear.weight.grad is not None for linear in linears)


def test_fused_projections_must_be_a_bool():
    with pytest.raises(TypeError, match="fused_projections must be true or false"):
        tiny("attention", None, {}, "yes")
