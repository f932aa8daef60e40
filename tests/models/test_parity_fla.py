"""hilo's layers against fla's (flash-linear-attention 0.6), with hilo's weights copied in (benchmarks/peer_models.py).

fla's kernels run on CUDA only: these tests skip without a GPU or without fla installed. Both sides run in fp32
(Triton's fp32 dots use TF32 on the GPU, so the tolerance is TF32's, not fp32's); the reference is hilo's chunked
PyTorch path (backend "torch"), which is exact in fp32. Each test also loads a deliberately wrong mapping and
requires the error to rise far above the tolerance, so a test that cannot tell the layers apart cannot pass.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's kernels need CUDA")
fla = pytest.importorskip("fla")

from benchmarks import peer_models
from hilo_kernels.common import error_ratio
from models import HiloConfig
from models.mixers.gated_deltanet import GatedDeltaNetMixer
from models.mixers.loglinear_mamba2 import LogLinearMamba2Mixer

TOL = 5e-3  # TF32 products on both sides
WRONG = 5e-2


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Every parameter drawn afresh (norm weights and gates away from their inits, so a swapped one shows)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * noise - 1.0)
            elif name.endswith(("norm.weight", "D", "L")):
                p.copy_(1.0 + 0.3 * noise)
            else:
                p.copy_(noise / max(p.shape[-1], 1) ** 0.5)


def run(layer, x, hilo: bool, backward: bool):
    """The layer's output, and with backward the gradients of its input and of every parameter (a fixed random
    cotangent)."""
    x = x.detach().clone().requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        if hilo:
            out = layer(x, torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1))
        else:
            out = layer(x)[0]
    if not backward:
        return out.detach(), None, {}
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(11)).to(out)
    try:
        out.backward(cotangent)
    except RuntimeError as err:  # fla 0.6 refuses its gated backward on Hopper with Triton 3.4 - 3.7.0
        if not hilo and "Triton" in str(err):
            pytest.skip(f"fla refuses this backward here: {err}")
        raise
    grads = {name: p.grad.detach().clone() for name, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return out.detach(), x.grad.detach(), grads


def errors_of(ref, peer, keys_map) -> dict[str, float]:
    """Error ratios of the peer's output and gradients against hilo's, by hilo parameter name."""
    out, dx, grads = ref
    p_out, p_dx, p_grads = peer
    errors = {"out": error_ratio(p_out, out)}
    if dx is not None:
        errors["dx"] = error_ratio(p_dx, dx)
    for key, grad in grads.items():
        errors[f"d{key}"] = error_ratio(p_grads[keys_map.get(key, key)], grad)
    return errors


def gated_deltanet_pair():
    config = HiloConfig(vocab_size=64, hidden_size=96, num_layers=1, mixer="gated_deltanet",
                        mixer_kwargs={"head_dim": 32, "num_heads": 3, "expand_v": 2, "backend": "torch"})
    hilo = GatedDeltaNetMixer(config, 0)
    randomize_(hilo, seed=3)
    hilo = hilo.cuda().train()
    x = torch.randn(2, 203, 96, generator=torch.Generator().manual_seed(5)).cuda()
    return hilo, peer_models.fla_gated_deltanet_layer(hilo, config).train(), x


def loglinear_mamba2_pair():
    config = HiloConfig(vocab_size=64, hidden_size=64, num_layers=1, num_heads=4, mixer="loglinear_mamba2",
                        max_position_embeddings=16384,
                        mixer_kwargs={"head_dim": 16, "state_size": 64, "expand": 2, "backend": "torch"})
    hilo = LogLinearMamba2Mixer(config, 0)
    randomize_(hilo, seed=4)
    hilo = hilo.cuda().train()
    x = torch.randn(2, 320, 64, generator=torch.Generator().manual_seed(6)).cuda()  # 5 chunks: levels up to 9
    return hilo, peer_models.fla_loglinear_mamba2_layer(hilo, config).train(), x


def swapped_a_b(state):
    state["a_proj.weight"], state["b_proj.weight"] = state["b_proj.weight"].clone(), state["a_proj.weight"].clone()
    return state


def swapped_levels(state):
    state["L"] = state["L"][:, [1, 0, *range(2, state["L"].shape[1])]].clone()
    return state


CASES = {"gated_deltanet": (gated_deltanet_pair, peer_models.GDN_LAYER_KEYS, swapped_a_b),
         "loglinear_mamba2": (loglinear_mamba2_pair, peer_models.LOGLINEAR_MAMBA2_LAYER_KEYS, swapped_levels)}


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("family", sorted(CASES))
def test_layer_matches_fla(family, backward):
    """hilo's layer and fla's on the same weights and inputs: output (and input and parameter gradients) within
    TF32 rounding; with two mapped parameters exchanged (a and b projections; two levels' weights) the peer's
    output must no longer match."""
    torch.manual_seed(0)
    make, keys, broken = CASES[family]
    hilo, peer, x = make()
    ref = run(hilo, x, hilo=True, backward=backward)
    errors = errors_of(ref, run(peer, x, hilo=False, backward=backward), keys)
    assert max(errors.values()) <= TOL, errors
    peer.load_state_dict(broken(peer.state_dict()))
    assert error_ratio(run(peer, x, hilo=False, backward=False)[0], ref[0]) > WRONG


# (hilo config, the peer's builder, sequence length: the layer tests' lengths, 320 = five of fla's log-linear chunks)
MODEL_CASES = {
    "gated_deltanet": ({"mixer": "gated_deltanet", "num_heads": 2,
                        "mixer_kwargs": {"head_dim": 32, "num_heads": 2, "expand_v": 2, "backend": "torch"}},
                       peer_models.fla_gated_deltanet_model, 203),
    "loglinear_mamba2": ({"mixer": "loglinear_mamba2", "num_heads": 4, "max_position_embeddings": 16384,
                          "mixer_kwargs": {"head_dim": 16, "state_size": 64, "expand": 2, "backend": "torch"}},
                         peer_models.fla_loglinear_mamba2_model, 320),
}


@pytest.mark.parametrize("family", sorted(MODEL_CASES))
def test_model_matches_fla(family):
    """The whole model (embeddings, pre-norm blocks with MLPs, final norm, LM head) against fla's CausalLM with hilo's
    weights, as benchmarks/lm_parity.py trains them: logits within TF32 rounding; with two layers' weights exchanged,
    no longer."""
    import models

    extra, build_peer, seq_len = MODEL_CASES[family]
    torch.manual_seed(0)
    hilo = models.build_model({"vocab_size": 96, "hidden_size": 64, "num_layers": 2, **extra})
    randomize_(hilo, seed=7)
    hilo = hilo.cuda().eval()
    peer = build_peer(hilo).eval()
    ids = torch.randint(0, 96, (2, seq_len), generator=torch.Generator().manual_seed(8)).cuda()
    with torch.no_grad():
        ref = hilo(input_ids=ids).logits.float()
        assert error_ratio(peer(input_ids=ids).logits.float(), ref) <= TOL
        state = peer.state_dict()
        layer0 = {k: v.clone() for k, v in state.items() if ".layers.0." in k}
        for key, value in layer0.items():
            state[key] = state[key.replace(".layers.0.", ".layers.1.")].clone()
            state[key.replace(".layers.0.", ".layers.1.")] = value
        peer.load_state_dict(state)
        assert error_ratio(peer(input_ids=ids).logits.float(), ref) > WRONG
