"""Weight mappings between hilo models and their transformers counterparts.

Three pairs, each as config functions (hilo config -> peer config and back) and state-dict functions (a source
config and its state dict -> the other side's state dict, tensors shared or reshaped, never re-initialised):

  transformer (mixer "attention", softmax_attn)   <->  transformers' LlamaForCausalLM
  mamba2 with mlp=False                           <->  transformers' Mamba2ForCausalLM
  one gated_deltanet layer (the mixer's own keys) <->  one Qwen3NextGatedDeltaNet layer (equal key and value
                                                        head counts)

Each function raises ConversionError naming what cannot be mapped when the two architectures do not match (a
hybrid's attention layers, a non-default operator, mlp or pre_conv on the wrong side, biases, activations, RoPE
scaling, grouped value heads, ...), and when a state dict has keys the mapping does not know or lacks keys it needs.
Options that only pick an implementation (attn_backend, mixer_kwargs.backend, fused_projections,
value_block) or only an initialisation (initializer_range, a_init_range, Mamba-2's chunk_size) are not
architecture and convert silently; init ranges with a counterpart (dt_min, dt_max) are carried over.

With weights mapped, each pair computes the same function (tests/models/test_parity.py checks logits, greedy
generate() tokens and the GDN layer's output in fp32); the layout differences handled here are Llama's separate
gate/up projections (hilo's gate_up_proj stacks them), Mamba-2's module names, and Qwen3-Next's per-key-head
interleaved [q, k, v, z] / [b, a] projections and single conv over cat(q, k, v).

On top of the two whole-model pairs, whole checkpoint directories (docs/checkpoints.md):

    python -m models.convert export runs/<name> <out dir> [--format auto|llama|mamba2]
    python -m models.convert import <transformers Llama or Mamba-2 dir> <out dir>

export_checkpoint writes a plain transformers directory (LlamaForCausalLM or Mamba2ForCausalLM: config.json,
safetensors weights, generation_config.json, the tokenizer as tokenizer.json) that loads with no hilo import;
import_checkpoint writes a hilo model directory (save_pretrained of HiloForCausalLM, the source's tokenizer files
beside it). A ConversionError names what cannot be mapped; the command prints it on one line and exits with 2.
"""

import argparse
import json
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import LlamaConfig, Mamba2Config, Qwen3NextConfig

from models.config import HiloConfig
from models.mixers.gated_deltanet import GatedDeltaNetMixer, default_num_heads
from models.mixers.mamba2 import Mamba2Mixer
from models.registry import mixer_options

StateDict = Mapping[str, torch.Tensor]


class ConversionError(ValueError):
    """A config or state dict that the requested mapping cannot represent on the other side."""


# ---------------------------------------------------------------------------------------------------------------
# shared checks


def _check_plain_stack(config: HiloConfig, main_mixer: str, mlp: bool, peer: str) -> None:
    """Every layer runs main_mixer with the shell's own operator, config.mlp == mlp, no pre_conv."""
    if config.operator is not None:
        raise ConversionError(f"{peer} has no operator {config.operator!r}: only the {config.mixer} shell's own "
                              f"operator (operator=null) maps")
    if config.mixer != main_mixer:
        raise ConversionError(f"{peer} maps hilo mixer {main_mixer!r}, got mixer {config.mixer!r}")
    others = [i for i in range(config.num_layers) if config.layer_mixer(i) != main_mixer]
    if others:
        raise ConversionError(f"{peer} has no hybrid layers: attn_layers {others} use softmax attention instead of "
                              f"{main_mixer!r}")
    if config.mlp != mlp:
        raise ConversionError(f"{peer} blocks {'have' if mlp else 'have no'} MLP: needs mlp={str(mlp).lower()}, got "
                              f"mlp={str(config.mlp).lower()}")
    if config.pre_conv is not None:
        raise ConversionError(f"{peer} has no conv before the mixer: needs pre_conv=null, got {config.pre_conv}")


def _take(state_dict: StateDict, used: set[str], key: str) -> torch.Tensor:
    if key not in state_dict:
        raise ConversionError(f"state dict lacks {key!r}")
    used.add(key)
    return state_dict[key]


def _check_all_used(state_dict: StateDict, used: set[str], optional: tuple[str, ...] = ()) -> None:
    unknown = sorted(set(state_dict) - used - set(optional))
    if unknown:
        raise ConversionError(f"state dict has keys the mapping does not know (an architecture it cannot map?): "
                              f"{unknown[:8]}{' ...' if len(unknown) > 8 else ''}")


def _head(state_dict: StateDict, used: set[str], embed_key: str, head_key: str, tied: bool) -> torch.Tensor:
    """The LM head weight: with tied embeddings, the embedding (a head in the state dict must equal it)."""
    embed = _take(state_dict, used, embed_key)
    if not tied:
        return _take(state_dict, used, head_key)
    if head_key in state_dict:
        used.add(head_key)
        if not torch.equal(state_dict[head_key], embed):
            raise ConversionError(f"tie_word_embeddings is true but {head_key!r} differs from {embed_key!r}: the "
                                  f"config and the weights disagree")
    return embed


def _as_int(value):
    """An integer-valued number as int (expand = 2.0 -> 2), else the value itself."""
    return int(value) if float(value).is_integer() else value


# ---------------------------------------------------------------------------------------------------------------
# Transformer <-> LlamaForCausalLM


def llama_config_from_hilo(config: HiloConfig) -> LlamaConfig:
    """The LlamaConfig of the same architecture as a hilo transformer (mixer "attention", softmax_attn).

    Llama's rms_norm_eps is hilo's norm_eps (both models put it in every RMSNorm); RoPE is the default rotate-half
    layout with hilo's rope_theta, which is hilo's layout (models/rope.py), so q and k need no permutation.
    """
    _check_plain_stack(config, "attention", True, "LlamaForCausalLM")
    return LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings, initializer_range=config.initializer_range,
        rms_norm_eps=config.norm_eps, rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        attention_bias=False, attention_dropout=0.0, mlp_bias=False, tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
    )


def hilo_config_from_llama(config: LlamaConfig, **overrides) -> HiloConfig:
    """The HiloConfig (transformer: mixer "attention") of a LlamaConfig; overrides set implementation options
    (attn_backend, fused_projections, ...). Raises ConversionError for what hilo's transformer does not have: biases, an
    activation other than SiLU, RoPE scaling (any rope_type but "default", partial rotary)."""
    if config.hidden_act != "silu":
        raise ConversionError(f"hilo's MLP is SwiGLU (SiLU): Llama hidden_act {config.hidden_act!r} does not map")
    if config.attention_bias or config.mlp_bias:
        raise ConversionError(f"hilo's projections have no bias: Llama attention_bias={config.attention_bias}, "
                              f"mlp_bias={config.mlp_bias} do not map")
    rope = dict(config.rope_parameters or {})
    if rope.get("rope_type", "default") != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConversionError(f"hilo's RoPE is the default full-width rotary embedding: Llama rope_parameters "
                              f"{rope} do not map")
    return HiloConfig(**{
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size, "num_layers": config.num_hidden_layers,
        "num_heads": config.num_attention_heads, "num_kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "intermediate_size": config.intermediate_size, "mixer": "attention",
        "rope_theta": rope.get("rope_theta", 10000.0), "max_position_embeddings": config.max_position_embeddings,
        "norm_eps": config.rms_norm_eps, "initializer_range": config.initializer_range,
        "tie_word_embeddings": config.tie_word_embeddings, "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id, **overrides})


def hilo_to_llama_state_dict(config: HiloConfig, state_dict: StateDict) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM's state dict from a hilo transformer's (HiloForCausalLM.state_dict() keys).

    gate_up_proj [2I, C] splits into Llama's gate_proj and up_proj (gate first: SwiGLU's SiLU(gate) * up).
    lm_head.weight is written in both the tied and the untied case (a tied model's state_dict has both keys).
    """
    llama_config_from_hilo(config)
    used: set[str] = set()
    out = {"model.embed_tokens.weight": _take(state_dict, used, "model.embed_tokens.weight"),
           "model.norm.weight": _take(state_dict, used, "model.norm.weight"),
           "lm_head.weight": _head(state_dict, used, "model.embed_tokens.weight", "lm_head.weight",
                                   config.tie_word_embeddings)}
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{dst}self_attn.{name}.weight"] = _take(state_dict, used, f"{src}mixer.{name}.weight")
        gate, up = _take(state_dict, used, f"{src}mlp.gate_up_proj.weight").chunk(2, dim=0)
        out[f"{dst}mlp.gate_proj.weight"], out[f"{dst}mlp.up_proj.weight"] = gate, up
        out[f"{dst}mlp.down_proj.weight"] = _take(state_dict, used, f"{src}mlp.down_proj.weight")
        out[f"{dst}input_layernorm.weight"] = _take(state_dict, used, f"{src}mixer_norm.weight")
        out[f"{dst}post_attention_layernorm.weight"] = _take(state_dict, used, f"{src}mlp_norm.weight")
    _check_all_used(state_dict, used)
    return out


def llama_to_hilo_state_dict(config: LlamaConfig, state_dict: StateDict) -> dict[str, torch.Tensor]:
    """A hilo transformer's state dict (for hilo_config_from_llama(config)) from LlamaForCausalLM's."""
    hilo_config_from_llama(config)
    used: set[str] = set()
    out = {"model.embed_tokens.weight": _take(state_dict, used, "model.embed_tokens.weight"),
           "model.norm.weight": _take(state_dict, used, "model.norm.weight"),
           "lm_head.weight": _head(state_dict, used, "model.embed_tokens.weight", "lm_head.weight",
                                   config.tie_word_embeddings)}
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{dst}mixer.{name}.weight"] = _take(state_dict, used, f"{src}self_attn.{name}.weight")
        out[f"{dst}mlp.gate_up_proj.weight"] = torch.cat([_take(state_dict, used, f"{src}mlp.gate_proj.weight"),
                                                          _take(state_dict, used, f"{src}mlp.up_proj.weight")])
        out[f"{dst}mlp.down_proj.weight"] = _take(state_dict, used, f"{src}mlp.down_proj.weight")
        out[f"{dst}mixer_norm.weight"] = _take(state_dict, used, f"{src}input_layernorm.weight")
        out[f"{dst}mlp_norm.weight"] = _take(state_dict, used, f"{src}post_attention_layernorm.weight")
    # non-persistent RoPE buffers of older checkpoints carry no weights
    _check_all_used(state_dict, used, tuple(k for k in state_dict if k.endswith("rotary_emb.inv_freq")))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Mamba-2 (mlp=False) <-> Mamba2ForCausalLM

# hilo Mamba2Mixer parameter -> transformers Mamba2Mixer parameter (same shapes, same layouts)
_MAMBA2_MIXER_KEYS = {"in_proj.weight": "in_proj.weight", "conv.conv.weight": "conv1d.weight",
                      "conv.conv.bias": "conv1d.bias", "A_log": "A_log", "dt_bias": "dt_bias", "D": "D",
                      "norm.weight": "norm.weight", "out_proj.weight": "out_proj.weight"}


def mamba2_config_from_hilo(config: HiloConfig) -> Mamba2Config:
    """The Mamba2Config of the same architecture as a hilo mamba2 model with mlp=False.

    Both compute, per layer, x + out_proj(RMSNorm_grouped(y * SiLU(z))) with y the SSD scan of the conv+SiLU'd
    x, B, C plus the D skip, dt = softplus(dt_proj + dt_bias), A = -exp(A_log); in_proj's [z | x, B, C | dt]
    split and the conv's [x, B, C] channel order are the same. layer_norm_epsilon is hilo's norm_eps (both use it
    in every norm); time_step_limit stays (0, inf): hilo does not clamp dt.
    """
    _check_plain_stack(config, "mamba2", False, "Mamba2ForCausalLM")
    opts = mixer_options(Mamba2Mixer.NAME, config.mixer_kwargs, Mamba2Mixer.DEFAULTS)
    expand = _as_int(opts["expand"])
    if not isinstance(expand, int):
        raise ConversionError(f"transformers' Mamba2Config takes an integer expand, got {opts['expand']}")
    d_inner, head_dim = expand * config.hidden_size, int(opts["head_dim"])
    return Mamba2Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_heads=d_inner // head_dim, head_dim=head_dim, state_size=int(opts["state_size"]), expand=expand,
        n_groups=int(opts["n_groups"]), conv_kernel=int(opts["conv_size"]), use_conv_bias=bool(opts["conv_bias"]),
        use_bias=False, hidden_act="silu", layer_norm_epsilon=config.norm_eps, time_step_limit=(0.0, float("inf")),
        time_step_min=opts["dt_min"], time_step_max=opts["dt_max"], initializer_range=config.initializer_range,
        tie_word_embeddings=config.tie_word_embeddings, bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
    )


def hilo_config_from_mamba2(config: Mamba2Config, **overrides) -> HiloConfig:
    """The HiloConfig (mixer "mamba2", mlp=False) of a Mamba2Config; overrides set implementation options.
    Raises ConversionError for biases on in_proj / out_proj, an activation other than SiLU, or a dt clamp
    (time_step_limit other than (0, inf)), which hilo's Mamba-2 does not have."""
    if config.use_bias:
        raise ConversionError("hilo's Mamba-2 in_proj / out_proj have no bias: Mamba2Config use_bias=True does "
                              "not map")
    if config.hidden_act != "silu":
        raise ConversionError(f"hilo's Mamba-2 conv activation is SiLU: hidden_act {config.hidden_act!r} does not "
                              f"map")
    low, high = config.time_step_limit
    if low != 0.0 or high != float("inf"):
        raise ConversionError(f"hilo's Mamba-2 does not clamp dt: time_step_limit {tuple(config.time_step_limit)} "
                              f"does not map (only (0, inf))")
    if config.num_heads * config.head_dim != config.expand * config.hidden_size:
        raise ConversionError(f"num_heads * head_dim ({config.num_heads * config.head_dim}) must equal expand * "
                              f"hidden_size ({config.expand * config.hidden_size})")
    mixer_kwargs = {"head_dim": config.head_dim, "state_size": config.state_size, "expand": config.expand,
                    "n_groups": config.n_groups, "conv_size": config.conv_kernel, "conv_bias": config.use_conv_bias,
                    "dt_min": config.time_step_min, "dt_max": config.time_step_max}
    overrides = dict(overrides)
    mixer_kwargs.update(overrides.pop("mixer_kwargs", {}))  # e.g. {"backend": "torch"}
    return HiloConfig(**{
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size, "num_layers": config.num_hidden_layers,
        "mixer": "mamba2", "mixer_kwargs": mixer_kwargs, "mlp": False, "norm_eps": config.layer_norm_epsilon,
        "initializer_range": config.initializer_range, "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id, **overrides})


def hilo_to_mamba2_state_dict(config: HiloConfig, state_dict: StateDict) -> dict[str, torch.Tensor]:
    """Mamba2ForCausalLM's state dict from a hilo mamba2 model's (mlp=False); only the names change."""
    conv_bias = mamba2_config_from_hilo(config).use_conv_bias
    used: set[str] = set()
    out = {"backbone.embeddings.weight": _take(state_dict, used, "model.embed_tokens.weight"),
           "backbone.norm_f.weight": _take(state_dict, used, "model.norm.weight"),
           "lm_head.weight": _head(state_dict, used, "model.embed_tokens.weight", "lm_head.weight",
                                   config.tie_word_embeddings)}
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"backbone.layers.{i}."
        out[f"{dst}norm.weight"] = _take(state_dict, used, f"{src}mixer_norm.weight")
        for ours, theirs in _MAMBA2_MIXER_KEYS.items():
            if ours == "conv.conv.bias" and not conv_bias:
                continue
            out[f"{dst}mixer.{theirs}"] = _take(state_dict, used, f"{src}mixer.{ours}")
    _check_all_used(state_dict, used)
    return out


def mamba2_to_hilo_state_dict(config: Mamba2Config, state_dict: StateDict) -> dict[str, torch.Tensor]:
    """A hilo mamba2 model's state dict (for hilo_config_from_mamba2(config)) from Mamba2ForCausalLM's."""
    hilo_config_from_mamba2(config)
    used: set[str] = set()
    out = {"model.embed_tokens.weight": _take(state_dict, used, "backbone.embeddings.weight"),
           "model.norm.weight": _take(state_dict, used, "backbone.norm_f.weight"),
           "lm_head.weight": _head(state_dict, used, "backbone.embeddings.weight", "lm_head.weight",
                                   config.tie_word_embeddings)}
    for i in range(config.num_hidden_layers):
        src, dst = f"backbone.layers.{i}.", f"model.layers.{i}."
        out[f"{dst}mixer_norm.weight"] = _take(state_dict, used, f"{src}norm.weight")
        for ours, theirs in _MAMBA2_MIXER_KEYS.items():
            if theirs == "conv1d.bias" and not config.use_conv_bias:
                continue
            out[f"{dst}mixer.{ours}"] = _take(state_dict, used, f"{src}mixer.{theirs}")
    _check_all_used(state_dict, used)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Gated DeltaNet layer <-> Qwen3NextGatedDeltaNet


def _gdn_sizes(config: HiloConfig) -> tuple[int, int, int, int]:
    """(num_heads, head_dim, head_v_dim, conv_size) of config's gated_deltanet layers, as GatedDeltaNetMixer
    derives them."""
    opts = mixer_options(GatedDeltaNetMixer.NAME, config.mixer_kwargs, GatedDeltaNetMixer.DEFAULTS)
    head_dim = int(opts["head_dim"])
    num_heads = int(opts["num_heads"] or default_num_heads(config.hidden_size, head_dim))
    return num_heads, head_dim, int(opts["expand_v"] * head_dim), int(opts["conv_size"])


def qwen3_next_gdn_config_from_hilo(config: HiloConfig) -> Qwen3NextConfig:
    """A Qwen3NextConfig whose linear-attention layers (Qwen3NextGatedDeltaNet) are hilo's gated_deltanet layers.

    Only the fields the GDN layer reads are meaningful (hidden_size, linear_*, rms_norm_eps, hidden_act: the
    conv's activation, SiLU); every layer is "linear_attention". A whole Qwen3-Next model is not a hilo model (its
    gated softmax attention, MoE MLPs and zero-centred (1 + w) RMSNorms have no hilo counterpart): this maps layers.
    """
    if config.main_mixer != "gated_deltanet":
        raise ConversionError(f"Qwen3NextGatedDeltaNet maps hilo's gated_deltanet layers (operator=null), got mixer "
                              f"{config.mixer!r} with operator {config.operator!r}")
    num_heads, head_dim, head_v_dim, conv_size = _gdn_sizes(config)
    return Qwen3NextConfig(
        hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        layer_types=["linear_attention"] * config.num_layers, linear_num_key_heads=num_heads,
        linear_num_value_heads=num_heads, linear_key_head_dim=head_dim, linear_value_head_dim=head_v_dim,
        linear_conv_kernel_dim=conv_size, rms_norm_eps=config.norm_eps, hidden_act="silu",
        vocab_size=config.vocab_size,
    )


def gated_deltanet_kwargs_from_qwen3_next(config: Qwen3NextConfig) -> dict:
    """(hilo mixer_kwargs for gated_deltanet, norm_eps) of a Qwen3NextConfig's linear-attention layers, as a dict
    {"mixer_kwargs": ..., "norm_eps": ...} to merge into a HiloConfig. Raises ConversionError for grouped value
    heads (linear_num_value_heads != linear_num_key_heads: hilo's q, k and v have the same head count) or a conv
    activation other than SiLU (Qwen3-Next's conv uses hidden_act)."""
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    if nk != nv:
        raise ConversionError(f"hilo's Gated DeltaNet has as many value heads as key heads: linear_num_key_heads="
                              f"{nk}, linear_num_value_heads={nv} do not map")
    if config.hidden_act != "silu":
        raise ConversionError(f"hilo's Gated DeltaNet conv activation is SiLU: hidden_act {config.hidden_act!r} "
                              f"does not map")
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    expand_v = dv // dk if dv % dk == 0 else dv / dk
    if int(expand_v * dk) != dv:
        raise ConversionError(f"value head dim {dv} is not expand_v * head_dim for any expand_v hilo derives "
                              f"exactly (head_dim {dk})")
    return {"mixer_kwargs": {"head_dim": dk, "num_heads": nk, "expand_v": expand_v,
                             "conv_size": config.linear_conv_kernel_dim},
            "norm_eps": config.rms_norm_eps}


def hilo_to_qwen3_next_gdn_state_dict(config: HiloConfig, state_dict: StateDict) -> dict[str, torch.Tensor]:
    """Qwen3NextGatedDeltaNet's state dict from one hilo GatedDeltaNetMixer's (mixer.state_dict() keys).

    in_proj_qkvz holds, per key head h, the rows [q_h | k_h | v_h | z_h] (z is hilo's output gate g_proj);
    in_proj_ba per head [b_h | a_h]; conv1d is one depthwise conv over cat(q, k, v) (hilo: q_conv, k_conv,
    v_conv); out_proj is o_proj.
    """
    qwen3_next_gdn_config_from_hilo(config)
    h, dk, dv, _ = _gdn_sizes(config)
    used: set[str] = set()

    def rows(name: str, per_head: int) -> torch.Tensor:
        w = _take(state_dict, used, f"{name}.weight")
        return w.view(h, per_head, w.shape[-1])

    qkvz = torch.cat([rows("q_proj", dk), rows("k_proj", dk), rows("v_proj", dv), rows("g_proj", dv)], dim=1)
    ba = torch.cat([rows("b_proj", 1), rows("a_proj", 1)], dim=1)
    conv = torch.cat([_take(state_dict, used, f"{n}_conv.conv.weight") for n in ("q", "k", "v")])
    out = {"in_proj_qkvz.weight": qkvz.reshape(-1, qkvz.shape[-1]), "in_proj_ba.weight": ba.reshape(-1, ba.shape[-1]),
           "conv1d.weight": conv, "A_log": _take(state_dict, used, "A_log"),
           "dt_bias": _take(state_dict, used, "dt_bias"), "norm.weight": _take(state_dict, used, "norm.weight"),
           "out_proj.weight": _take(state_dict, used, "o_proj.weight")}
    _check_all_used(state_dict, used)
    return out


def qwen3_next_gdn_to_hilo_state_dict(config: Qwen3NextConfig, state_dict: StateDict) -> dict[str, torch.Tensor]:
    """One hilo GatedDeltaNetMixer's state dict from one Qwen3NextGatedDeltaNet's (the inverse of
    hilo_to_qwen3_next_gdn_state_dict)."""
    gated_deltanet_kwargs_from_qwen3_next(config)
    h, dk, dv = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    used: set[str] = set()
    qkvz = _take(state_dict, used, "in_proj_qkvz.weight")
    c = qkvz.shape[-1]
    q, k, v, z = qkvz.view(h, 2 * dk + 2 * dv, c).split([dk, dk, dv, dv], dim=1)
    b, a = _take(state_dict, used, "in_proj_ba.weight").view(h, 2, c).split([1, 1], dim=1)
    conv_q, conv_k, conv_v = _take(state_dict, used, "conv1d.weight").split([h * dk, h * dk, h * dv])
    out = {"q_proj.weight": q.reshape(-1, c), "k_proj.weight": k.reshape(-1, c), "v_proj.weight": v.reshape(-1, c),
           "g_proj.weight": z.reshape(-1, c), "b_proj.weight": b.reshape(-1, c), "a_proj.weight": a.reshape(-1, c),
           "q_conv.conv.weight": conv_q, "k_conv.conv.weight": conv_k, "v_conv.conv.weight": conv_v,
           "A_log": _take(state_dict, used, "A_log"), "dt_bias": _take(state_dict, used, "dt_bias"),
           "norm.weight": _take(state_dict, used, "norm.weight"),
           "o_proj.weight": _take(state_dict, used, "out_proj.weight")}
    _check_all_used(state_dict, used)
    return out


# ---------------------------------------------------------------------------------------------------------------
# checkpoint directories: export (hilo -> transformers) and import (transformers -> hilo)

EXPORT_FORMATS = ("auto", "llama", "mamba2")
EXPORTABLE = ("hilo exports two families, the ones with a transformers CausalLM of the same architecture: the "
              "transformer (mixer=attention, operator=null) as LlamaForCausalLM and mamba2 with mlp=false as "
              "Mamba2ForCausalLM")
# the files of a transformers tokenizer directory (copied on import)
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                       "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja")


def _check_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"output directory {str(out)!r} exists and is not empty; pick another one or "
                                  f"pass overwrite=True (--overwrite)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a save_pretrained directory (*.safetensors, else pytorch_model*.bin), dtypes as saved."""
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        weights: dict[str, torch.Tensor] = {}
        for f in files:
            weights.update(load_file(f))
        return weights
    files = sorted(model_dir.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"{str(model_dir)!r} holds no weights (*.safetensors or pytorch_model*.bin)")
    weights = {}
    for f in files:
        weights.update(torch.load(f, map_location="cpu", weights_only=True))
    return weights


def _save_model(model_cls, config, state_dict: dict[str, torch.Tensor], out: Path) -> None:
    """save_pretrained of model_cls(config) holding state_dict's tensors (built on the meta device: nothing is
    initialised, every parameter comes from state_dict)."""
    dtypes = {v.dtype for v in state_dict.values() if v.is_floating_point()}
    if len(dtypes) == 1:
        config.dtype = next(iter(dtypes))
    with torch.device("meta"):
        model = model_cls(config)
    model.load_state_dict(state_dict, strict=True, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)


def _hilo_source(src: str | Path) -> tuple[Path, Path | None]:
    """(model dir, hilo tokenizer dir or None) of a hilo model dir, a checkpoint (step) dir or a run dir (its
    newest checkpoint, as eval.py finds it)."""
    from training.checkpoint import TOKENIZER_FILE, resolve_checkpoint

    p = Path(src).expanduser()
    if (p / "config.json").is_file():  # a model dir: the tokenizer is the checkpoint's, beside it
        tok = p.parent / "tokenizer"
        return p, tok if (tok / TOKENIZER_FILE).is_file() else None
    ckpt = resolve_checkpoint(p)  # a clear FileNotFoundError for anything else
    tok = ckpt / "tokenizer"
    return ckpt / "model", tok if (tok / TOKENIZER_FILE).is_file() else None


def _export_format(config: HiloConfig, fmt: str) -> str:
    if fmt not in EXPORT_FORMATS:
        raise ConversionError(f"unknown export format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}")
    if fmt != "auto":
        return fmt
    if config.mixer == "attention" and config.operator is None:
        return "llama"
    if config.mixer == "mamba2" and config.operator is None:
        return "mamba2"
    what = f"mixer={config.mixer}" + ("" if config.operator is None else f" operator={config.operator}")
    why = "transformers has no CausalLM that computes it"
    if config.main_mixer == "gated_deltanet":
        why += (" (hilo's gated_deltanet maps to Qwen3-Next's GDN layers only, at layer level: the rest of a "
                "Qwen3-Next model is not hilo's)")
    raise ConversionError(f"cannot export a model with {what}: {EXPORTABLE}; {why}")


def sentencepiece_to_hf(model_file: str | Path):
    """A transformers fast tokenizer (PreTrainedTokenizerFast over a tokenizers BPE) that encodes and decodes as
    hilo's SentencePiece BPE model does (data/tokenizer.py: identity normalisation, no dummy prefix, byte
    fallback, whitespace kept): spaces become U+2581 and the merges are ranked by the merged piece's score. The
    text is split into SentencePiece's training words (a run of U+2581 and what follows it), which no piece
    crosses: the ids are the same without the split, which only keeps each BPE word short. Needs no sentencepiece
    to load.

    No BOS or EOS is added to an encoding (hilo trains on documents each followed by EOS, with no BOS); the
    tokenizer has no pad piece, so pad is EOS."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model_file).read_bytes())
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    problems = []
    if trainer.model_type != sentencepiece_model_pb2.TrainerSpec.BPE:
        problems.append(f"model_type {sentencepiece_model_pb2.TrainerSpec.ModelType.Name(trainer.model_type)} "
                        f"(only BPE)")
    if norm.name != "identity" or norm.precompiled_charsmap:
        problems.append(f"normalization {norm.name!r} (only identity)")
    if norm.add_dummy_prefix or not norm.escape_whitespaces or norm.remove_extra_whitespaces:
        problems.append("add_dummy_prefix / remove_extra_whitespaces set or escape_whitespaces unset")
    if trainer.treat_whitespace_as_suffix or not trainer.split_by_whitespace:
        problems.append("treat_whitespace_as_suffix or split_by_whitespace=false")
    if problems:
        raise ConversionError(f"SentencePiece model {str(model_file)!r} was not trained as hilo trains its "
                              f"tokenizer (data/tokenizer.py): {'; '.join(problems)} do not map")
    pieces = proto.pieces
    vocab = {p.piece: i for i, p in enumerate(pieces)}
    normal = sentencepiece_model_pb2.ModelProto.SentencePiece.NORMAL
    merges = []
    for i, p in enumerate(pieces):
        if p.type != normal:
            continue
        merges += [(p.piece[:k], p.piece[k:], i) for k in range(1, len(p.piece))
                   if p.piece[:k] in vocab and p.piece[k:] in vocab]
    merges.sort(key=lambda m: (-pieces[m[2]].score, m[2], vocab[m[0]]))

    def piece(i: int) -> str | None:
        return pieces[i].piece if 0 <= i < len(pieces) else None

    unk, bos, eos = piece(trainer.unk_id), piece(trainer.bos_id), piece(trainer.eos_id)
    pad = piece(trainer.pad_id) or eos
    tok = Tokenizer(BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges], unk_token=unk, fuse_unk=True,
                        byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("\u2581*[^\u2581]+|\u2581+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=unk, bos_token=bos, eos_token=eos,
                                   pad_token=pad, clean_up_tokenization_spaces=False)


def _export_tokenizer(tok_dir: Path, out: Path) -> tuple[object, str]:
    """Write the checkpoint's tokenizer as transformers tokenizer files in out; (tokenizer, a note on it)."""
    from transformers import AutoTokenizer

    from training.checkpoint import TOKENIZER_FILE

    spec = json.loads((tok_dir / TOKENIZER_FILE).read_text())
    if spec["type"] == "sentencepiece":
        tok = sentencepiece_to_hf(tok_dir / spec["file"])
        note = "SentencePiece model -> tokenizer.json (pad = eos: the model has no pad piece)"
    elif spec["type"] == "hf":  # the files as the run saved them; rewritten only to add a pad token
        src = tok_dir / spec["file"]
        for f in src.iterdir():
            if f.is_file() and f.name != TOKENIZER_FILE:
                shutil.copyfile(f, out / f.name)
        tok = AutoTokenizer.from_pretrained(out)
        note = "transformers tokenizer files, copied"
        if tok.pad_token is not None:
            return tok, note
        tok.pad_token = tok.eos_token
        note += " (pad = eos: the tokenizer has none)"
    else:
        raise ConversionError(f"{str(tok_dir)!r} holds a tokenizer of type {spec['type']!r}: only sentencepiece "
                              f"and hf tokenizers export")
    tok.save_pretrained(out)
    # PreTrainedTokenizerFast is what transformers 4 and 5 both build from tokenizer.json (5 writes its own
    # backend's class name, which 4 does not know)
    cfg_file = out / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("tokenizer_class") == "TokenizersBackend":
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")
    return tok, note


def export_checkpoint(src: str | Path, out: str | Path, format: str = "auto", *, overwrite: bool = False) -> dict:
    """Write a hilo checkpoint (a run dir, its newest checkpoint; a step dir; or a model dir) as a plain
    transformers directory: LlamaForCausalLM (format "llama") or Mamba2ForCausalLM ("mamba2"; "auto" picks by the
    model's mixer), with the checkpoint's tokenizer. Loads with AutoModelForCausalLM / AutoTokenizer and no hilo
    import. Returns {"out", "format", "architecture", "tokenizer"} (what was written). Raises ConversionError for a
    model that neither architecture represents (gated_deltanet, hybrids, operators, mlp on a mamba2, ...)."""
    from transformers import LlamaForCausalLM, Mamba2ForCausalLM

    model_dir, tok_dir = _hilo_source(src)
    config_dict = json.loads((model_dir / "config.json").read_text())
    if config_dict.get("model_type") != HiloConfig.model_type:
        raise ConversionError(f"{str(model_dir)!r} is not a hilo model (model_type "
                              f"{config_dict.get('model_type')!r}); export takes hilo checkpoints, import takes "
                              f"transformers ones")
    config = HiloConfig.from_pretrained(model_dir)
    fmt = _export_format(config, format)
    to_config, to_state, model_cls = {"llama": (llama_config_from_hilo, hilo_to_llama_state_dict, LlamaForCausalLM),
                                      "mamba2": (mamba2_config_from_hilo, hilo_to_mamba2_state_dict,
                                                 Mamba2ForCausalLM)}[fmt]
    try:
        peer_config = to_config(config)
        state_dict = to_state(config, _read_weights(model_dir))
    except ConversionError as e:
        raise ConversionError(f"cannot export as {model_cls.__name__}: {e}; {EXPORTABLE}") from None
    out = Path(out).expanduser()
    _check_out_dir(out, overwrite)
    note = "none (no tokenizer beside the model)"
    if tok_dir is not None:
        tok, note = _export_tokenizer(tok_dir, out)
        peer_config.bos_token_id, peer_config.eos_token_id = tok.bos_token_id, tok.eos_token_id
        peer_config.pad_token_id = tok.pad_token_id
    _save_model(model_cls, peer_config, state_dict, out)
    if fmt == "mamba2":
        # transformers 5 writes the (0, inf) dt limit as {"__float__": "Infinity"}, which transformers 4 (and tools
        # pinned to it) cannot read; (0, inf) is Mamba2Config's default in both, so the key is left out
        config_file = out / "config.json"
        written = json.loads(config_file.read_text())
        if written.get("time_step_limit") == [0.0, {"__float__": "Infinity"}]:
            del written["time_step_limit"]
            config_file.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    return {"out": out, "format": fmt, "architecture": model_cls.__name__, "tokenizer": note}


def import_checkpoint(src: str | Path, out: str | Path, *, overwrite: bool = False, **overrides) -> dict:
    """Write a transformers LlamaForCausalLM or Mamba2ForCausalLM directory as a hilo model directory
    (save_pretrained of HiloForCausalLM: `import models; AutoModelForCausalLM.from_pretrained(out)`), with the
    source's tokenizer files copied beside the weights (so tokenizer=hf with name_or_path=out reads them).
    overrides set hilo implementation options (attn_backend, fused_projections, ...). Returns {"out", "family",
    "tokenizer"}. Raises ConversionError for a model type or an option hilo has no counterpart for."""
    from transformers import AutoConfig

    from models.lm import HiloForCausalLM

    src = Path(src).expanduser()
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{str(src)!r} holds no config.json: pass a transformers model directory (what "
                                f"save_pretrained writes)")
    model_type = json.loads((src / "config.json").read_text()).get("model_type")
    if model_type not in ("llama", "mamba2"):
        hint = " (it is already a hilo model)" if model_type == HiloConfig.model_type else ""
        raise ConversionError(f"cannot import model_type {model_type!r}{hint}: hilo imports transformers' llama "
                              f"(as its transformer) and mamba2 (as mamba2 with mlp=false)")
    peer_config = AutoConfig.from_pretrained(src)
    to_config, to_state = {"llama": (hilo_config_from_llama, llama_to_hilo_state_dict),
                           "mamba2": (hilo_config_from_mamba2, mamba2_to_hilo_state_dict)}[model_type]
    try:
        config = to_config(peer_config, **overrides)
        state_dict = to_state(peer_config, _read_weights(src))
    except ConversionError as e:
        raise ConversionError(f"cannot import {model_type}: {e}") from None
    out = Path(out).expanduser()
    _check_out_dir(out, overwrite)
    _save_model(HiloForCausalLM, config, state_dict, out)
    copied = [name for name in _HF_TOKENIZER_FILES if (src / name).is_file()]
    for name in copied:
        shutil.copyfile(src / name, out / name)
    return {"out": out, "family": "transformer" if model_type == "llama" else "mamba2",
            "tokenizer": f"copied {', '.join(copied)}" if copied else "none (the source has no tokenizer files)"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m models.convert",
        description="Convert checkpoints between hilo and transformers (docs/checkpoints.md). export: a hilo "
                    "transformer or mamba2 (mlp=false) checkpoint -> a LlamaForCausalLM / Mamba2ForCausalLM "
                    "directory with its tokenizer, loadable without hilo (transformers, vLLM, "
                    "lm-evaluation-harness). import: a transformers Llama or Mamba-2 directory -> a hilo model "
                    "directory. Exits with 2 and one line naming what cannot be mapped when the architectures "
                    "differ.")
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="hilo checkpoint -> transformers directory",
                         description=f"Export a hilo checkpoint as a plain transformers directory. {EXPORTABLE}.")
    exp.add_argument("src", help="a run dir (runs/<name>: its newest checkpoint), a checkpoint dir "
                                 "(runs/<name>/checkpoints/step_XXXXXXXX) or a hilo model dir (its model/)")
    exp.add_argument("out", help="the transformers directory to write (must be empty or new)")
    exp.add_argument("--format", choices=EXPORT_FORMATS, default="auto",
                     help="llama (transformer), mamba2 (mamba2, mlp=false) or auto: picked by the model's mixer "
                          "(default)")
    imp = sub.add_parser("import", help="transformers Llama / Mamba-2 directory -> hilo model directory",
                         description="Import a transformers LlamaForCausalLM or Mamba2ForCausalLM directory as a "
                                     "hilo model directory (load it with `import models; "
                                     "AutoModelForCausalLM.from_pretrained(out)`); its tokenizer files are "
                                     "copied beside the weights.")
    imp.add_argument("src", help="a transformers model directory (config.json model_type llama or mamba2)")
    imp.add_argument("out", help="the hilo model directory to write (must be empty or new)")
    for p in (exp, imp):
        p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line of output per conversion
    try:
        if args.command == "export":
            done = export_checkpoint(args.src, args.out, args.format, overwrite=args.overwrite)
            print(f"wrote {done['out']}: {done['architecture']}; tokenizer: {done['tokenizer']}")
        else:
            done = import_checkpoint(args.src, args.out, overwrite=args.overwrite)
            print(f"wrote {done['out']}: hilo {done['family']}; tokenizer: {done['tokenizer']}")
    except (ConversionError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
