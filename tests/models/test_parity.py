"""models.convert: hilo against implementations written elsewhere (transformers' PyTorch paths), CPU, fp32.

With the weights of a randomly initialised hilo model mapped by models.convert, the peer must give the same logits
(error ratio <= 1e-5, hilo_kernels.common.error_ratio) and, where both decode with a cache, the same greedy generate()
tokens:

  hilo transformer             vs  LlamaForCausalLM (RoPE rotate-half, GQA 3 -> 1, SwiGLU, RMSNorm)
  hilo mamba2, mlp=False       vs  Mamba2ForCausalLM (torch path: no mamba_ssm / causal_conv1d)
  hilo GatedDeltaNetMixer      vs  Qwen3NextGatedDeltaNet (torch path, key heads = value heads), layer level:
                                   same input hidden states -> same output, also through a cached decode

Conventions, and which side they live on (none needed a change to hilo):
  - Llama: rotate-half RoPE is hilo's layout too (models/rope.py), so q/k rows need no permutation; rms_norm_eps is
    set to hilo's norm_eps; hilo's gate_up_proj is Llama's [gate_proj; up_proj] stacked (a layout difference).
  - Mamba-2: both sides use the paper's (Dao & Gu 2024) block: y = SSD(x, dt, A, B, C) + D x (the D skip, per
    head), dt = softplus(dt_proj + dt_bias), A = -exp(A_log), then the gated RMSNorm as norm(y * SiLU(z)) (gate
    before the norm, grouped by n_groups) and out_proj; in_proj's [z | x, B, C | dt] order is the same. Differences
    are initialisation only (transformers sets A_log = log(1..H), hilo exp(A_log) ~ U[1, 16]) and transformers'
    optional dt clamp time_step_limit, which the mapping keeps at (0, inf) and refuses otherwise.
    layer_norm_epsilon (transformers' default 1e-5) is set to hilo's norm_eps.
  - Gated DeltaNet: both follow the paper (Yang, Kautz & Hatamizadeh 2024): a causal depthwise conv + SiLU on q, k
    and v, q and k L2-normalised as x / sqrt(sum x^2 + 1e-6) (the same epsilon and form on both sides), scale
    head_dim ** -0.5, beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), then RMSNorm(o) * SiLU(z) (norm
    before the gate) and the output projection. Qwen3-Next interleaves q, k, v, z (and b, a) per key head in two
    projections and runs one conv over cat(q, k, v): a layout difference, handled by the mapping. rms_norm_eps is
    set to hilo's norm_eps.

Each test also perturbs one mapped pair of weights (two heads, gate and up, B and C, ...) and requires the error to
become large, so a mapping that is wrong in that way cannot pass.
"""

import pytest
import torch
from transformers import LlamaForCausalLM, Mamba2ForCausalLM
from transformers.cache_utils import DynamicCache
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from hilo_kernels.common import error_ratio
from models import HiloCache, HiloConfig, HiloForCausalLM, convert
from models.mixers.gated_deltanet import GatedDeltaNetMixer

TOL = 1e-5
VOCAB = 89


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Every parameter drawn at a scale where each of them moves the output (hilo's 0.02 init leaves near-uniform
    logits): projections N(0, 1/fan_in), norm weights around 1, decays moderate (exp(A_log) in [0.3, 1.5],
    softplus(dt_bias) around 0.13), D and conv taps O(1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif leaf == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(0.3, 1.5, generator=gen).log())
            elif leaf == "dt_bias":
                p.copy_(-2 + 0.5 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 3:  # conv taps [C, 1, K]
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2:
                std = 1.0 if "embed" in name else p.shape[1] ** -0.5
                p.copy_(std * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen))


def tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, prompt: torch.Tensor, new: int) -> torch.Tensor:
    return model.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)


def swapped(state_dict: dict, a: str, b: str, rows: tuple[slice, slice] | None = None) -> dict:
    """state_dict with tensors a and b exchanged (or, with rows, two row ranges of tensor a)."""
    out = dict(state_dict)
    if rows is None:
        out[a], out[b] = state_dict[b], state_dict[a]
    else:
        w = state_dict[a].clone()
        w[rows[0]], w[rows[1]] = state_dict[a][rows[1]], state_dict[a][rows[0]]
        out[a] = w
    return out


def peer_logits(model, state_dict: dict, ids: torch.Tensor) -> torch.Tensor:
    model.load_state_dict(state_dict, strict=True)
    with torch.no_grad():
        return model(ids).logits


# --------------------------------------------------------------------------------------------------------------


LLAMA = {"vocab_size": VOCAB, "hidden_size": 48, "num_layers": 2, "num_heads": 3, "num_kv_heads": 1,
         "head_dim": 16, "intermediate_size": 72, "rope_theta": 500.0, "mixer": "attention"}


@pytest.mark.parametrize("tied", [False, True])
def test_transformer_matches_llama(tied):
    """hilo's transformer and LlamaForCausalLM: logits, and greedy tokens (KV caches on both sides)."""
    torch.manual_seed(0)
    config = HiloConfig(**LLAMA, tie_word_embeddings=tied)
    hilo = HiloForCausalLM(config).eval()
    randomize_(hilo, seed=1)
    llama = LlamaForCausalLM(convert.llama_config_from_hilo(config)).eval()
    mapped = convert.hilo_to_llama_state_dict(config, hilo.state_dict())
    ids = tokens(2, 23, seed=2)
    with torch.no_grad():
        ref = hilo(ids).logits
    assert error_ratio(peer_logits(llama, mapped, ids), ref) <= TOL
    # and back: the inverse mapping of the peer's own state dict gives hilo's config and weights exactly
    assert convert.hilo_config_from_llama(llama.config).to_diff_dict() == config.to_diff_dict()
    back = convert.llama_to_hilo_state_dict(llama.config, llama.state_dict())
    assert back.keys() == hilo.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in hilo.state_dict().items())
    if not tied:  # decoding does not depend on the tie; one run of it is enough
        prompt = tokens(2, 5, seed=3)
        assert torch.equal(greedy(llama, prompt, 10), greedy(hilo, prompt, 10))
    # a mapping that swapped the two heads' query rows, or the SwiGLU gate and up, would not pass
    q = "model.layers.0.self_attn.q_proj.weight"
    assert error_ratio(peer_logits(llama, swapped(mapped, q, q, (slice(0, 16), slice(16, 32))), ids), ref) > 1e-2
    gate, up = "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"
    assert error_ratio(peer_logits(llama, swapped(mapped, gate, up), ids), ref) > 1e-2


# --------------------------------------------------------------------------------------------------------------


MAMBA2 = {"vocab_size": VOCAB, "hidden_size": 48, "num_layers": 2, "mixer": "mamba2", "mlp": False,
          "mixer_kwargs": {"head_dim": 12, "state_size": 10, "expand": 2, "n_groups": 2, "conv_size": 4}}


def test_mamba2_matches_transformers():
    """hilo's mamba2 (mlp=False; 8 heads of 12, state 10, 2 groups) and Mamba2ForCausalLM: logits over more than
    one of the peer's chunks, and greedy tokens (conv and SSM states cached on both sides)."""
    torch.manual_seed(0)
    config = HiloConfig(**MAMBA2)
    hilo = HiloForCausalLM(config).eval()
    randomize_(hilo, seed=4)
    peer_config = convert.mamba2_config_from_hilo(config)
    peer_config.chunk_size = 16  # an implementation choice of the peer's scan: 40 tokens cross two chunk boundaries
    peer = Mamba2ForCausalLM(peer_config).eval()
    mapped = convert.hilo_to_mamba2_state_dict(config, hilo.state_dict())
    ids = tokens(2, 40, seed=5)
    with torch.no_grad():
        ref = hilo(ids).logits
    assert error_ratio(peer_logits(peer, mapped, ids), ref) <= TOL
    assert convert.hilo_config_from_mamba2(peer_config).mixer_kwargs == {
        **MAMBA2["mixer_kwargs"], "conv_bias": True, "dt_min": 1e-3, "dt_max": 1e-1}
    back = convert.mamba2_to_hilo_state_dict(peer_config, peer.state_dict())
    assert back.keys() == hilo.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in hilo.state_dict().items())
    prompt = tokens(2, 6, seed=6)
    assert torch.equal(greedy(peer, prompt, 10), greedy(hilo, prompt, 10))
    # B and C exchanged (the two n_groups * state_size row blocks of in_proj after x), or D zeroed, would not pass
    w = "backbone.layers.0.mixer.in_proj.weight"
    xs = 96 + 96  # z, then x
    bc = swapped(mapped, w, w, (slice(xs, xs + 20), slice(xs + 20, xs + 40)))
    assert error_ratio(peer_logits(peer, bc, ids), ref) > 1e-2
    no_d = dict(mapped, **{"backbone.layers.1.mixer.D": torch.zeros(8)})
    assert error_ratio(peer_logits(peer, no_d, ids), ref) > 1e-2


# --------------------------------------------------------------------------------------------------------------


GDN = {"vocab_size": VOCAB, "hidden_size": 48, "num_layers": 1, "mixer": "gated_deltanet",
       "mixer_kwargs": {"head_dim": 12, "num_heads": 3, "expand_v": 2, "conv_size": 4}}


def test_gated_deltanet_layer_matches_qwen3_next():
    """hilo's GatedDeltaNetMixer (3 heads, K = 12, V = 24) and Qwen3NextGatedDeltaNet on the same hidden states:
    the chunked prefill, then three cached single-token steps (each side's recurrent path)."""
    torch.manual_seed(0)
    config = HiloConfig(**GDN)
    hilo = GatedDeltaNetMixer(config, 0).eval()
    randomize_(hilo, seed=7)
    peer_config = convert.qwen3_next_gdn_config_from_hilo(config)
    peer = Qwen3NextGatedDeltaNet(peer_config, 0).eval()
    mapped = convert.hilo_to_qwen3_next_gdn_state_dict(config, hilo.state_dict())
    peer.load_state_dict(mapped, strict=True)
    kwargs = convert.gated_deltanet_kwargs_from_qwen3_next(peer_config)
    assert kwargs == {"mixer_kwargs": GDN["mixer_kwargs"], "norm_eps": config.norm_eps}
    back = convert.qwen3_next_gdn_to_hilo_state_dict(peer_config, peer.state_dict())
    assert back.keys() == hilo.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in hilo.state_dict().items())
    x = torch.randn(2, 70, 48, generator=torch.Generator().manual_seed(8))  # two of the peer's 64-token chunks
    positions = torch.arange(70).expand(2, 70)
    cache, peer_cache = HiloCache([False]), DynamicCache(config=peer_config)
    with torch.no_grad():
        ref = hilo(x[:, :67], positions[:, :67], None, cache)
        out = peer(x[:, :67], cache=peer_cache)
        assert error_ratio(out, ref) <= TOL
        cache.advance(67)
        for t in range(67, 70):
            ref = hilo(x[:, t:t + 1], positions[:, t:t + 1], None, cache)
            cache.advance(1)
            assert error_ratio(peer(x[:, t:t + 1], cache=peer_cache), ref) <= TOL
        ref = hilo(x, positions)
        # the output gate z and the value rows of head 0 exchanged, or a and b, would not pass
        qkvz = "in_proj_qkvz.weight"
        for bad in (swapped(mapped, qkvz, qkvz, (slice(24, 48), slice(48, 72))),
                    swapped(mapped, "in_proj_ba.weight", "in_proj_ba.weight", (slice(0, 1), slice(1, 2)))):
            peer.load_state_dict(bad, strict=True)
            assert error_ratio(peer(x), ref) > 1e-2


# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, match", [
    ({"attn_layers": [1], "mixer": "mamba2"}, "mixer 'mamba2'"),
    ({"operator": "hla2"}, "operator 'hla2'"),
    ({"mlp": False}, "needs mlp=true"),
    ({"pre_conv": 3}, "pre_conv=null"),
])
def test_llama_mapping_refuses_other_architectures(overrides, match):
    with pytest.raises(convert.ConversionError, match=match):
        convert.llama_config_from_hilo(HiloConfig(**{**LLAMA, **overrides}))


def test_mappings_name_what_does_not_map():
    hybrid = HiloConfig(**{**MAMBA2, "attn_layers": [0]})
    with pytest.raises(convert.ConversionError, match=r"attn_layers \[0\]"):
        convert.mamba2_config_from_hilo(hybrid)
    with pytest.raises(convert.ConversionError, match="needs mlp=false"):
        convert.mamba2_config_from_hilo(HiloConfig(**{**MAMBA2, "mlp": True}))
    with pytest.raises(convert.ConversionError, match="operator"):
        convert.qwen3_next_gdn_config_from_hilo(HiloConfig(**{**GDN, "operator": "hla2"}))
    config = HiloConfig(**LLAMA, tie_word_embeddings=True)
    state = HiloForCausalLM(config).state_dict()
    state["lm_head.weight"] = state["lm_head.weight"] + 1  # tied in the config, not in the weights
    with pytest.raises(convert.ConversionError, match="tie_word_embeddings"):
        convert.hilo_to_llama_state_dict(config, state)
    state = HiloForCausalLM(HiloConfig(**LLAMA)).state_dict()
    with pytest.raises(convert.ConversionError, match="does not know"):
        convert.hilo_to_llama_state_dict(HiloConfig(**LLAMA), {**state, "model.layers.0.pre_conv.conv.weight": 0})
    llama = convert.llama_config_from_hilo(HiloConfig(**LLAMA))
    llama.mlp_bias = True
    with pytest.raises(convert.ConversionError, match="mlp_bias=True"):
        convert.hilo_config_from_llama(llama)
    llama = convert.llama_config_from_hilo(HiloConfig(**LLAMA))
    llama.rope_parameters = {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}
    with pytest.raises(convert.ConversionError, match="rope_parameters"):
        convert.hilo_config_from_llama(llama)
    mamba = convert.mamba2_config_from_hilo(HiloConfig(**MAMBA2))
    mamba.time_step_limit = (0.0, 0.1)
    with pytest.raises(convert.ConversionError, match="time_step_limit"):
        convert.hilo_config_from_mamba2(mamba)
    qwen = convert.qwen3_next_gdn_config_from_hilo(HiloConfig(**GDN))
    qwen.linear_num_value_heads = 6
    with pytest.raises(convert.ConversionError, match="linear_num_value_heads=6"):
        convert.gated_deltanet_kwargs_from_qwen3_next(qwen)
