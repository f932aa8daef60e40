"""benchmarks/lm_parity.py: the same recipe trains hilo's model and its peer from equal weights to equal losses
(fp32 on CPU, where the transformer pair runs), and the table reads the seed spread beside the difference."""
from __future__ import annotations

import itertools

import pytest
import torch

from benchmarks import lm_parity, peer_models
from hilo_kernels.common.metrics import error_ratio
from models import build_model


def tiny_transformer(seed: int):
    torch.manual_seed(seed)
    return build_model({"vocab_size": 97, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "mixer": "attention",
                        "max_position_embeddings": 64})


def test_schedule_warms_up_then_decays_to_a_tenth():
    lrs = [lm_parity.lr_at(s, 100, 1e-3) for s in range(100)]
    assert lrs[0] == 1e-4 and lrs[9] == 1e-3
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))
    assert abs(lrs[-1] - 1e-4) < 2e-6


def test_hilo_and_peer_train_alike_from_equal_weights():
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 97, (2, 33), generator=gen) for _ in range(6)]
    val = torch.randint(0, 97, (4, 33), generator=gen)
    results = []
    for seed in (0, 1):
        hilo = tiny_transformer(seed)
        peer = peer_models.llama_model(hilo)
        for impl, model in (("hilo", hilo), ("peer", peer)):
            results.append({"family": "transformer", "impl": impl, "seed": seed, "status": "ok",
                            **lm_parity.train(model, batches, val, 3e-3, "cpu")})
    by = {(r["impl"], r["seed"]): r for r in results}
    seed_spread = abs(by[("hilo", 0)]["val_loss"] - by[("hilo", 1)]["val_loss"])
    for seed in (0, 1):
        assert abs(by[("hilo", seed)]["val_loss"] - by[("peer", seed)]["val_loss"]) < min(1e-5, seed_spread / 10)
        assert by[("hilo", seed)]["train_loss_tail"] < by[("hilo", seed)]["train_loss_curve"][0]  # it learned
    text = lm_parity.table(results)
    assert "| transformer | hilo | 0 |" in text and "spread between seeds" in text
    # a peer whose LM head is not hilo's trains to another loss: the comparison can tell them apart
    hilo = tiny_transformer(0)
    peer = peer_models.llama_model(hilo)
    with torch.no_grad():
        peer.lm_head.weight.mul_(-1.0)
    bad = lm_parity.train(peer, batches, val, 3e-3, "cpu")
    assert abs(bad["val_loss"] - by[("hilo", 0)]["val_loss"]) > 1e-4


def test_mamba2_pair_trains_alike_from_equal_weights():
    """hilo's Mamba-2 without MLPs and transformers' Mamba2ForCausalLM (its PyTorch path on CPU)."""
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 97, (2, 33), generator=gen) for _ in range(4)]
    val = torch.randint(0, 97, (2, 33), generator=gen)
    torch.manual_seed(0)
    hilo = build_model({"vocab_size": 97, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "mixer": "mamba2",
                        "mlp": False,
                        "mixer_kwargs": {"head_dim": 16, "state_size": 16}})
    peer = peer_models.mamba2_model(hilo)
    ours, theirs = (lm_parity.train(m, batches, val, 3e-3, "cpu") for m in (hilo, peer))
    assert type(peer).__name__ == "Mamba2ForCausalLM"
    assert abs(ours["val_loss"] - theirs["val_loss"]) < 1e-5


def test_gated_deltanet_qwen3_next_pair_is_the_same_model_and_trains_alike():
    """hilo's Gated DeltaNet model and transformers' Qwen3NextForCausalLM with every layer linear attention (its
    PyTorch path): equal logits from the mapped weights (norm weights moved off zero, so the zero-centred norms'
    w - 1 is exercised), then equal losses after training from them."""
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 97, (2, 70), generator=gen) for _ in range(3)]
    val = torch.randint(0, 97, (2, 70), generator=gen)  # 70 tokens: two of the peer's 64-token chunks
    torch.manual_seed(0)
    hilo = build_model({"vocab_size": 97, "hidden_size": 48, "num_layers": 2, "mixer": "gated_deltanet",
                        "mixer_kwargs": {"head_dim": 12, "num_heads": 3, "expand_v": 2, "conv_size": 4},
                        "max_position_embeddings": 128})
    with torch.no_grad():
        for name, p in hilo.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    peer = peer_models.qwen3_next_gated_deltanet_model(hilo)
    assert type(peer).__name__ == "Qwen3NextForCausalLM"
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    # the layers call transformers' own PyTorch functions, not the wrappers that pick fla's or causal_conv1d's
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn"):
        assert not hasattr(getattr(qwen3_next, name), "__wrapped__"), name
    assert all(layer.linear_attn is not None and type(layer.mlp).__name__ == "Qwen3NextMLP"
               for layer in peer.model.layers)
    with torch.no_grad():
        assert error_ratio(peer(input_ids=val).logits, hilo(val).logits) <= 1e-5
    ours, theirs = (lm_parity.train(m, batches, val, 3e-3, "cpu") for m in (hilo, peer))
    assert abs(ours["val_loss"] - theirs["val_loss"]) < 1e-5
    assert "gated_deltanet_qwen3_next" in lm_parity.PEERS and lm_parity.HILO_FAMILY["gated_deltanet_qwen3_next"] == (
        "gated_deltanet")


def test_a_peer_that_raises_is_a_failed_row_and_hilo_failures_propagate():
    """Any exception of the peer's (fla's version checks raise RuntimeError, a kernel that does not compile on this
    Triton its CompilationError) becomes the row's status, so the other rows still run; hilo's own is raised."""
    class CompilationError(Exception):
        """As Triton's: not a RuntimeError."""

    class Refusing(torch.nn.Module):
        def __init__(self, err):
            super().__init__()
            self.weight, self.err = torch.nn.Parameter(torch.zeros(2, 2)), err

        def forward(self, **_):
            raise self.err

    batches, val = [torch.zeros(1, 5, dtype=torch.long)] * 2, torch.zeros(1, 5, dtype=torch.long)
    for err, status in ((CompilationError("at 12:4:\n    x = tl.dot(a, b)\n\nValueError: shapes"),
                         "failed: CompilationError: at 12:4: ... ValueError: shapes"),
                        (RuntimeError("Triton >= 3.4 refuses"), "failed: RuntimeError: Triton >= 3.4 refuses"),
                        (ValueError(), "failed: ValueError")):
        assert lm_parity.train_or_refusal("peer", Refusing(err), batches, val, 1e-3, "cpu") == {"status": status}
    with pytest.raises(CompilationError, match="ours"):  # hilo's own failure propagates
        lm_parity.train_or_refusal("hilo", Refusing(CompilationError("ours")), batches, val, 1e-3, "cpu")
