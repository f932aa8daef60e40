"""Peer implementations of hilo's layers and models, with hilo's weights copied in (for parity tests and the
language-model comparison, benchmarks/lm_parity.py).

    fla_gated_deltanet_layer(mixer, config)    fla's GatedDeltaNet layer == hilo's GatedDeltaNetMixer
    fla_loglinear_mamba2_layer(mixer, config)  fla's LogLinearMamba2 layer == hilo's LogLinearMamba2Mixer
    fla_gated_deltanet_model(model)            fla's GatedDeltaNetForCausalLM == a hilo gated_deltanet model
    fla_loglinear_mamba2_model(model)          fla's LogLinearMamba2ForCausalLM == a hilo loglinear_mamba2 model
                                                (with MLPs, max_position_embeddings = 16384)
    llama_model(model)                          transformers' LlamaForCausalLM == a hilo transformer
    mamba2_model(model)                         transformers' Mamba2ForCausalLM == a hilo mamba2 model (mlp=false;
                                                mamba_ssm's kernels when installed, else its PyTorch path)
    qwen3_next_gated_deltanet_model(model)     transformers' Qwen3NextForCausalLM, every layer linear attention
                                                (Qwen3NextGatedDeltaNet) with a dense MLP, on its PyTorch path ==
                                                a hilo gated_deltanet model

fla (flash-linear-attention, its kernels need CUDA) is imported when a builder is called, never by hilo itself.
Each builder makes the peer with the same sizes as the hilo module, loads the mapped state dict strictly (every
peer parameter is set from a hilo one) and returns it on the hilo module's device and dtype. The mappings are key
renames: fla's layers hold the same parameters under other names (q_conv1d for q_conv.conv, o_norm for norm,
embeddings for embed_tokens, attn / attn_norm for mixer / mixer_norm, split gate and up projections).
"""
from __future__ import annotations

import torch
from torch import nn

# hilo GatedDeltaNetMixer key -> fla GatedDeltaNet key (keys not listed keep their name)
GDN_LAYER_KEYS = {"q_conv.conv.weight": "q_conv1d.weight", "k_conv.conv.weight": "k_conv1d.weight",
                  "v_conv.conv.weight": "v_conv1d.weight", "norm.weight": "o_norm.weight"}
# hilo Mamba2Mixer / LogLinearMamba2Mixer key -> fla LogLinearMamba2 key
LOGLINEAR_MAMBA2_LAYER_KEYS = {"conv.conv.weight": "conv1d.weight", "conv.conv.bias": "conv1d.bias"}


def renamed(state_dict: dict[str, torch.Tensor], keys: dict[str, str], prefix: str = "",
            new_prefix: str = "") -> dict[str, torch.Tensor]:
    """state_dict's entries under prefix, renamed by keys (the rest keep their name) and put under new_prefix."""
    out = {}
    for key, value in state_dict.items():
        if key.startswith(prefix):
            rest = key[len(prefix):]
            out[new_prefix + keys.get(rest, rest)] = value
    return out


def split_mlp(state_dict: dict[str, torch.Tensor], prefix: str, new_prefix: str) -> dict[str, torch.Tensor]:
    """hilo's SwiGLU under prefix (one gate_up_proj, gate rows first) as the peers' gate_proj, up_proj, down_proj."""
    gate, up = state_dict[f"{prefix}gate_up_proj.weight"].chunk(2, dim=0)
    return {f"{new_prefix}gate_proj.weight": gate, f"{new_prefix}up_proj.weight": up,
            f"{new_prefix}down_proj.weight": state_dict[f"{prefix}down_proj.weight"]}


def _load(peer: nn.Module, state_dict: dict[str, torch.Tensor], like: nn.Module) -> nn.Module:
    peer.load_state_dict(state_dict, strict=True)
    param = next(like.parameters())
    return peer.to(device=param.device, dtype=param.dtype)


def _fla_causal_lm_state(model: nn.Module, mixer_keys: dict[str, str], *, backbone: str, final_norm: str, mixer: str,
                         mixer_norm: str) -> dict[str, torch.Tensor]:
    """A hilo model's weights under the names of an fla CausalLM of pre-norm blocks with MLPs: the embeddings and the
    final norm under backbone, each block's mixer (its keys renamed by mixer_keys) and mixer norm under the peer's
    names for them, the MLP norm and the split SwiGLU, and the LM head."""
    state = model.state_dict()
    mapped = {f"{backbone}.embeddings.weight": state["model.embed_tokens.weight"],
              f"{backbone}.{final_norm}.weight": state["model.norm.weight"], "lm_head.weight": state["lm_head.weight"]}
    for i in range(model.config.num_layers):
        src, dst = f"model.layers.{i}.", f"{backbone}.layers.{i}."
        mapped.update(renamed(state, mixer_keys, f"{src}mixer.", f"{dst}{mixer}."))
        mapped[f"{dst}{mixer_norm}.weight"] = state[f"{src}mixer_norm.weight"]
        mapped[f"{dst}mlp_norm.weight"] = state[f"{src}mlp_norm.weight"]
        mapped.update(split_mlp(state, f"{src}mlp.", f"{dst}mlp."))
    return mapped


def fla_gated_deltanet_layer(mixer: nn.Module, config) -> nn.Module:
    """fla's GatedDeltaNet with the sizes and weights of a hilo GatedDeltaNetMixer (q, k and v heads equal)."""
    from fla.layers import GatedDeltaNet

    peer = GatedDeltaNet(hidden_size=config.hidden_size, expand_v=mixer.head_v_dim / mixer.head_dim,
                         head_dim=mixer.head_dim, num_heads=mixer.num_heads, mode="chunk", use_gate=True,
                         use_short_conv=True, conv_size=mixer.q_conv.kernel_size, conv_bias=False,
                         layer_idx=mixer.layer_idx, norm_eps=config.norm_eps)
    return _load(peer, renamed(mixer.state_dict(), GDN_LAYER_KEYS), mixer)


def fla_loglinear_mamba2_layer(mixer: nn.Module, config) -> nn.Module:
    """fla's LogLinearMamba2 with the sizes and weights of a hilo LogLinearMamba2Mixer. fla fixes the level count
    at 15 (sequences up to 16K): the hilo model needs max_position_embeddings = 16384 for the same in_proj."""
    from fla.layers import LogLinearMamba2
    from fla.layers.log_linear_mamba2 import MAX_NUM_LEVELS

    if mixer.num_levels != MAX_NUM_LEVELS:
        raise ValueError(f"fla's LogLinearMamba2 has {MAX_NUM_LEVELS} levels, the hilo mixer {mixer.num_levels}: "
                         f"build the hilo model with max_position_embeddings=16384")
    peer = LogLinearMamba2(num_heads=mixer.num_heads, head_dim=mixer.head_dim, hidden_size=config.hidden_size,
                           state_size=mixer.state_size, expand=mixer.d_inner // config.hidden_size,
                           n_groups=mixer.n_groups, conv_kernel=mixer.conv.kernel_size,
                           use_conv_bias=mixer.conv.conv.bias is not None, rmsnorm=True, norm_before_gate=False,
                           chunk_size=64, use_bias=False, norm_eps=config.norm_eps, layer_idx=mixer.layer_idx,
                           backend="triton")
    return _load(peer, renamed(mixer.state_dict(), LOGLINEAR_MAMBA2_LAYER_KEYS), mixer)


def fla_gated_deltanet_model(model: nn.Module) -> nn.Module:
    """fla's GatedDeltaNetForCausalLM with the sizes and weights of a hilo gated_deltanet model (every layer a
    GatedDeltaNetMixer with an MLP, pre-norm blocks, final norm, LM head)."""
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    config = model.config
    mixer = model.model.layers[0].mixer
    peer_config = GatedDeltaNetConfig(
        hidden_size=config.hidden_size, expand_v=mixer.head_v_dim / mixer.head_dim, head_dim=mixer.head_dim,
        num_heads=mixer.num_heads, use_gate=True, use_short_conv=True, conv_size=mixer.q_conv.kernel_size,
        max_position_embeddings=config.max_position_embeddings, intermediate_size=config.intermediate_size,
        hidden_act="swish", num_hidden_layers=config.num_layers, norm_eps=config.norm_eps,
        vocab_size=config.vocab_size, tie_word_embeddings=config.tie_word_embeddings,
        initializer_range=config.initializer_range, fuse_cross_entropy=False, use_cache=False,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id)
    mapped = _fla_causal_lm_state(model, GDN_LAYER_KEYS, backbone="model", final_norm="norm", mixer="attn",
                                  mixer_norm="attn_norm")
    return _load(GatedDeltaNetForCausalLM(peer_config), mapped, model)


def fla_loglinear_mamba2_model(model: nn.Module) -> nn.Module:
    """fla's LogLinearMamba2ForCausalLM with the sizes and weights of a hilo loglinear_mamba2 model: every layer a
    LogLinearMamba2Mixer with an MLP (fla's blocks always have one, of 4 x 2/3 x hidden_size rounded up to 256, hilo's
    default), pre-norm blocks, final norm, LM head. fla fixes 15 levels: build the hilo model with
    max_position_embeddings = 16384."""
    from fla.models import LogLinearMamba2Config, LogLinearMamba2ForCausalLM

    config = model.config
    mixer = model.model.layers[0].mixer
    fla_intermediate = 256 * -(-int(config.hidden_size * 4 * 2 / 3) // 256)
    if not config.mlp or config.intermediate_size != fla_intermediate:
        raise ValueError(f"fla's LogLinearMamba2 blocks have an MLP of width {fla_intermediate}; the hilo model has "
                         f"{config.intermediate_size if config.mlp else 'none'}: build it with model.mlp=true and "
                         f"model.intermediate_size=null")
    peer_config = LogLinearMamba2Config(
        num_heads=mixer.num_heads, head_dim=mixer.head_dim, vocab_size=config.vocab_size,
        hidden_size=config.hidden_size, state_size=mixer.state_size, num_hidden_layers=config.num_layers,
        norm_eps=config.norm_eps, expand=mixer.d_inner // config.hidden_size, conv_kernel=mixer.conv.kernel_size,
        n_groups=mixer.n_groups, use_bias=False, use_conv_bias=mixer.conv.conv.bias is not None,
        residual_in_fp32=False, rmsnorm=True, norm_before_gate=False, chunk_size=64, fuse_cross_entropy=False,
        initializer_range=config.initializer_range, tie_word_embeddings=config.tie_word_embeddings, use_cache=False,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id)
    mapped = _fla_causal_lm_state(model, LOGLINEAR_MAMBA2_LAYER_KEYS, backbone="backbone", final_norm="norm_f",
                                  mixer="mixer", mixer_norm="mixer_norm")
    return _load(LogLinearMamba2ForCausalLM(peer_config), mapped, model)


def llama_model(model: nn.Module) -> nn.Module:
    """transformers' LlamaForCausalLM with the weights of a hilo transformer (models.convert's mapping)."""
    from transformers import LlamaForCausalLM

    from models import convert

    peer_config = convert.llama_config_from_hilo(model.config)
    peer_config._attn_implementation = "sdpa"
    peer = LlamaForCausalLM(peer_config)
    return _load(peer, convert.hilo_to_llama_state_dict(model.config, model.state_dict()), model)


def mamba2_model(model: nn.Module) -> nn.Module:
    """transformers' Mamba2ForCausalLM with the weights of a hilo mamba2 model without MLPs (models.convert's
    mapping)."""
    from transformers import Mamba2ForCausalLM

    from models import convert

    peer = Mamba2ForCausalLM(convert.mamba2_config_from_hilo(model.config))
    return _load(peer, convert.hilo_to_mamba2_state_dict(model.config, model.state_dict()), model)


def _qwen3_next_torch_path():
    """Make transformers' Qwen3-Next layers take their own PyTorch delta rule and conv. At import, transformers
    binds the kernels of fla and causal_conv1d when they are importable; fla's training backward refuses Hopper
    with Triton >= 3.4, < 3.7.1, and the peer is meant to be an implementation independent of fla."""
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        fn = getattr(qwen3_next, name, None)
        if fn is None:
            raise ImportError(f"transformers' Qwen3-Next has no {name}: this transformers version is not the one "
                              f"peer_models.py reads (5.x)")
        while hasattr(fn, "__wrapped__"):  # the hub-kernel wrapper around the PyTorch function
            fn = fn.__wrapped__
        setattr(qwen3_next, name, fn)


def qwen3_next_gated_deltanet_model(model: nn.Module) -> nn.Module:
    """transformers' Qwen3NextForCausalLM with the sizes and weights of a hilo gated_deltanet model: every layer
    "linear_attention" (Qwen3NextGatedDeltaNet, models.convert's layer mapping) and a dense MLP, on the PyTorch path
    (_qwen3_next_torch_path). Qwen3-Next's RMSNorms are zero-centred (x_hat * (1 + w)): they get hilo's weights
    minus one, the same function, and the same Adam updates (the gradient w.r.t. w is the same)."""
    from transformers import Qwen3NextForCausalLM

    from models import convert

    _qwen3_next_torch_path()
    config = model.config
    peer_config = convert.qwen3_next_gdn_config_from_hilo(config)
    layers = list(range(config.num_layers))
    peer_config.mlp_only_layers = layers
    peer_config.intermediate_size = config.intermediate_size
    peer_config.tie_word_embeddings = config.tie_word_embeddings
    peer_config.initializer_range = config.initializer_range
    peer_config.use_cache = False
    state = model.state_dict()
    mapped = {"model.embed_tokens.weight": state["model.embed_tokens.weight"],
              "model.norm.weight": state["model.norm.weight"] - 1, "lm_head.weight": state["lm_head.weight"]}
    for i in layers:
        layer = f"model.layers.{i}."  # the same prefix on both sides
        mixer = renamed(state, {}, f"{layer}mixer.")
        mapped.update(renamed(convert.hilo_to_qwen3_next_gdn_state_dict(config, mixer), {}, "",
                              f"{layer}linear_attn."))
        mapped[f"{layer}input_layernorm.weight"] = state[f"{layer}mixer_norm.weight"] - 1
        mapped[f"{layer}post_attention_layernorm.weight"] = state[f"{layer}mlp_norm.weight"] - 1
        mapped.update(split_mlp(state, f"{layer}mlp.", f"{layer}mlp."))
    return _load(Qwen3NextForCausalLM(peer_config), mapped, model)
