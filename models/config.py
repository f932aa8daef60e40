"""HiloConfig: the one configuration class of every hilo model (model_type "hilo")."""

import math
import shutil
from pathlib import Path
from typing import ClassVar

from transformers import PretrainedConfig

# Keys a user (or a Hydra model config) may set; build_model rejects anything else.
CONFIG_KEYS = (
    "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
    "mixer", "operator", "attn_layers", "mixer_kwargs", "attn_backend", "rope_theta", "max_position_embeddings",
    "norm_eps", "initializer_range", "tie_word_embeddings", "use_cache", "bos_token_id", "eos_token_id",
    "pad_token_id", "mlp", "pre_conv", "fused_loss_chunk", "loss_at_targets_only", "fused_projections",
    "embed_dropout",
)


def default_intermediate_size(hidden_size: int) -> int:
    """SwiGLU width: hidden * 4 * 2/3 rounded up to a multiple of 256."""
    return 256 * math.ceil(hidden_size * 8 / 3 / 256)


# The remote code a saved model directory carries (models/modeling_hilo.py, which imports hilo's installed packages)
# and config.json's auto_map naming its classes: AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)
# then loads without `import models` (docs/checkpoints.md).
REMOTE_CODE_FILE = "modeling_hilo.py"
AUTO_MAP = {"AutoConfig": "modeling_hilo.HiloConfig", "AutoModel": "modeling_hilo.HiloModel",
            "AutoModelForCausalLM": "modeling_hilo.HiloForCausalLM"}


# Per shell (config.mixer) that takes config.operator: operator -> registered mixer that runs it there. The first
# entry is the shell's own operator (what operator=None means).
SHELL_OPERATORS: dict[str, dict[str, str]] = {
    "attention": {"softmax_attn": "attention", "hla2": "hla", "ahla": "hla", "hla3": "hla"},
    "mamba2": {"linear_attn": "mamba2", "hla2": "hla_mamba2", "ahla": "hla_mamba2", "hla3": "hla_mamba2"},
    "gated_deltanet": {"delta_rule": "gated_deltanet", "hla2": "hla_gated_deltanet", "ahla": "hla_gated_deltanet",
                       "hla3": "hla_gated_deltanet"},
}


class HiloConfig(PretrainedConfig):
    """Architecture of a hilo language model.

    Every layer is the same Block (pre-norm mixer + SwiGLU MLP; mlp=False drops the MLP, pre_conv=K puts a
    depthwise causal short conv of kernel size K between the mixer's norm and the mixer: the Based/Zoology MQAR
    recipe, models.blocks.Block); layer i uses the "attention" mixer (softmax)
    when i is in attn_layers and config.main_mixer otherwise: config.mixer (the shell), or, when operator is
    given, the mixer that runs that operator in the shell (SHELL_OPERATORS: the transformer shell "attention"
    takes softmax_attn, hla2, ahla, hla3; "mamba2" linear_attn, hla2, ahla, hla3; "gated_deltanet" delta_rule,
    hla2, ahla, hla3; operator None is the shell's own). mixer_kwargs is passed through to
    config.main_mixer's class (each mixer validates its own options). attn_backend is the softmax_attn backend
    of attention layers (None: flash when importable on CUDA, else sdpa). head_dim None -> hidden_size / num_heads;
    num_kv_heads None -> num_heads; intermediate_size None -> default_intermediate_size(hidden_size).
    fused_loss_chunk: rows per chunk of the chunked LM-head cross-entropy (models.loss) that HiloForCausalLM uses
    when called with labels and return_logits=False; None makes that call materialise all logits and take the
    plain loss instead (the same value; more memory).
    loss_at_targets_only: that loss runs the LM head only at the positions that have a target (labels not -100),
    the same value and gradients for one host synchronisation a step: for tasks with few labelled positions, such
    as MQAR (a query per key-value pair), where the head over every position would be most of the step.
    fused_projections: the projections that read the same layer input (attention's q, k, v; the HLA and Gated
    DeltaNet layers' q, k, v, output gate and decay / beta projections) as one matmul of their stacked weights
    (models.casts.ProjectionInput.project: the same products and parameters; one read of the input and one input
    gradient). Off by default until measured on a GPU.
    embed_dropout: dropout on the token embeddings in training (Zoology's MQAR models use 0.1); 0 by default, and
    no call is made then.
    """

    model_type = "hilo"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]
    attribute_map: ClassVar[dict[str, str]] = {
        "num_hidden_layers": "num_layers",
        "num_attention_heads": "num_heads",
        "num_key_value_heads": "num_kv_heads",
    }

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 768,
        num_layers: int = 12,
        num_heads: int = 12,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        intermediate_size: int | None = None,
        mixer: str = "attention",
        operator: str | None = None,
        attn_layers: list[int] | None = None,
        mixer_kwargs: dict | None = None,
        attn_backend: str | None = None,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 2048,
        norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        use_cache: bool = True,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        mlp: bool = True,
        pre_conv: int | None = None,
        fused_loss_chunk: int | None = 4096,
        loss_at_targets_only: bool = False,
        fused_projections: bool = False,
        embed_dropout: float = 0.0,
        **kwargs,
    ):
        if num_kv_heads is None:
            num_kv_heads = num_heads
        if head_dim is None:
            if hidden_size % num_heads != 0:
                raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads}) "
                                 f"when head_dim is not given")
            head_dim = hidden_size // num_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if intermediate_size is None:
            intermediate_size = default_intermediate_size(hidden_size)
        if operator is not None and operator not in SHELL_OPERATORS.get(mixer, {}):
            if mixer in SHELL_OPERATORS:
                valid = list(SHELL_OPERATORS[mixer])
                raise ValueError(f"unknown operator {operator!r} for mixer {mixer!r}; valid operators: {valid} "
                                 f"(or null for {valid[0]})")
            raise ValueError(f"mixer {mixer!r} takes no operator (got {operator!r}); mixers with operators: "
                             f"{sorted(SHELL_OPERATORS)}")
        if not isinstance(mlp, bool):
            raise TypeError(f"mlp must be true or false, got {mlp!r}")
        if pre_conv is not None and (isinstance(pre_conv, bool) or not isinstance(pre_conv, int) or pre_conv < 1):
            raise ValueError(f"pre_conv must be null (no conv before the mixer) or a kernel size >= 1, "
                             f"got {pre_conv!r}")
        if fused_loss_chunk is not None and (
                isinstance(fused_loss_chunk, bool) or not isinstance(fused_loss_chunk, int) or fused_loss_chunk < 1):
            raise ValueError(f"fused_loss_chunk must be null (plain loss) or a number of rows >= 1, "
                             f"got {fused_loss_chunk!r}")
        if not isinstance(loss_at_targets_only, bool):
            raise TypeError(f"loss_at_targets_only must be true or false, got {loss_at_targets_only!r}")
        if not isinstance(fused_projections, bool):
            raise TypeError(f"fused_projections must be true or false, got {fused_projections!r}")
        if isinstance(embed_dropout, bool) or not isinstance(embed_dropout, (int, float)) or not 0 <= embed_dropout < 1:
            raise ValueError(f"embed_dropout must be a probability in [0, 1), got {embed_dropout!r}")
        attn_layers = sorted(int(i) for i in (attn_layers or []))
        bad = [i for i in attn_layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"attn_layers {bad} out of range for num_layers={num_layers}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.intermediate_size = intermediate_size
        self.mixer = mixer
        self.operator = operator
        self.attn_layers = attn_layers
        self.mixer_kwargs = dict(mixer_kwargs or {})
        self.attn_backend = attn_backend
        self.rope_theta = float(rope_theta)
        self.max_position_embeddings = max_position_embeddings
        self.norm_eps = norm_eps
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        self.mlp = mlp
        self.pre_conv = pre_conv
        self.fused_loss_chunk = fused_loss_chunk
        self.loss_at_targets_only = loss_at_targets_only
        self.fused_projections = fused_projections
        self.embed_dropout = float(embed_dropout)
        super().__init__(
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            **kwargs,
        )

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        """PretrainedConfig.save_pretrained, with config.json's auto_map naming the remote code (AUTO_MAP) and that
        code (models/modeling_hilo.py) copied beside it, so the directory (and every model saved through it) loads
        with trust_remote_code=True and no `import models`."""
        self.auto_map = dict(AUTO_MAP)
        Path(save_directory).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(__file__).with_name(REMOTE_CODE_FILE), Path(save_directory) / REMOTE_CODE_FILE)
        return super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig") -> None:
        """Nothing to register: transformers calls this on a class loaded as remote code, and save_pretrained would
        then copy this module in place of the remote code and rewrite auto_map; hilo's directories carry their own
        (save_pretrained above)."""

    @property
    def main_mixer(self) -> str:
        """Registered name of the mixer of the layers outside attn_layers (config.mixer running config.operator)."""
        if self.operator is None:
            return self.mixer
        return SHELL_OPERATORS[self.mixer][self.operator]

    def layer_mixer(self, layer_idx: int) -> str:
        """Registered name of the mixer used by layer layer_idx."""
        return "attention" if layer_idx in self.attn_layers else self.main_mixer
