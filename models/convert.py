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

Whole checkpoint directories are converted on top of these by training/convert.py (docs/checkpoints.md).
"""

from collections.abc import Mapping

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
