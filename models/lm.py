"""HF wrappers: HiloPreTrainedModel, HiloModel (embeddings + Blocks + final norm), HiloForCausalLM."""

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from models.blocks import Block
from models.cache import HiloCache
from models.config import HiloConfig
from models.loss import IGNORE_INDEX, chunked_cross_entropy
from models.norms import RMSNorm
from models.padding import mask_positions, pad, target_mask, unpad, unpad_mask

# transformers >= 5.2x renamed the outputs' cache field from past_key_values to cache (the old name still
# works but warns); fill whichever this install declares.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
_TF_MAJOR = int(transformers.__version__.split(".")[0])


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[1, total] positions restarting at 0 at every document start of cu_seqlens [N+1]."""
    cu = cu_seqlens.to(torch.long)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=total)
    return (torch.arange(total, device=cu.device) - starts).unsqueeze(0)


class HiloPreTrainedModel(PreTrainedModel):
    """Weight init and HF plumbing shared by HiloModel and HiloForCausalLM.

    Init: every Linear and the embedding ~ N(0, initializer_range); projections that write into the residual
    stream (attention o_proj, MLP down_proj: flagged _is_residual_proj) use initializer_range / sqrt(2 *
    num_layers); RMSNorm weights are 1.
    """

    config_class = HiloConfig
    base_model_prefix = "model"
    _no_split_modules: ClassVar[list[str]] = ["Block"]
    supports_gradient_checkpointing = True
    _is_stateful = False

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModel") -> None:
        """Nothing to register (as HiloConfig.register_for_auto_class): a saved directory's remote code and auto_map
        are HiloConfig.save_pretrained's, whichever way the model was loaded."""

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            if getattr(module, "_is_residual_proj", False):
                std = std / math.sqrt(2 * self.config.num_layers)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)


class HiloModel(HiloPreTrainedModel):
    """Token embeddings -> num_layers Blocks -> final RMSNorm; returns the last hidden states [B, T, C]."""

    def __init__(self, config: HiloConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.gradient_checkpointing = False
        self._decode_step = None  # compile_decoding's compiled layers for single-token cached steps
        self.post_init()

    def compile_decoding(self, mode: str | None = None, enabled: bool = True, backend="inductor") -> None:
        """torch.compile the layers (and the final norm) of single-token decoding steps with a cache, the path
        generate() takes after the prompt; mode is torch.compile's ("reduce-overhead" adds CUDA graphs on a GPU).
        Eager decoding is bound by the host cost of ~800-2,400 operators per token at 340m;
        compiled, inductor fuses the elementwise ones. The prompt's forward, training
        and anything with gradients stay eager. Log-linear states are grown on the host before each step
        and KV caches make room on the host first (HiloCache.prepare_step), so a step's code neither depends on the
        position nor checks storage. enabled=False turns it off again; backend is torch.compile's (tests use
        "aot_eager": the same capture without code generation)."""
        if enabled and not (hasattr(torch, "compile") and torch._dynamo.is_dynamo_supported()):
            import sys

            raise RuntimeError(f"compile_decoding: torch.compile does not run with torch {torch.__version__} on Python "
                               f"{sys.version.split()[0]}; decode eagerly (leave compile_decoding off)")
        self._decode_step = torch.compile(self._run_layers, mode=mode, backend=backend) if enabled else None

    def _run_layers(self, hidden: torch.Tensor, position_ids: torch.Tensor, cache: HiloCache | None) -> torch.Tensor:
        """The blocks of a cached decoding step and the final norm (compile_decoding compiles this)."""
        for block in self.layers:
            hidden = block(hidden, position_ids, None, cache)
        if cache is not None and cache.step_prepared:
            cache.commit_step()
        return self.norm(hidden)

    @staticmethod
    def _read_mask(mask, b, t, past, cache, cu_seqlens, position_ids):
        """(unpadded, key_mask, position_ids) for a forward given attention_mask: the packing of a padded batch
        that starts from nothing (None when the mask is all ones), or, continuing a cache of padded rows, the key
        mask [B, past + T] and the rows' own positions (position_ids unless given)."""
        if mask.ndim != 2 or mask.shape[0] != b or mask.shape[1] not in (t, past + t):
            cols = f"{t}" if not past else f"{t} or {past + t} (the {past} cached tokens and the {t} new ones)"
            raise ValueError(f"attention_mask must be [B, T] with B = {b} and T = {cols} columns, got "
                             f"{tuple(mask.shape)}")
        new = mask[:, mask.shape[1] - t:]
        if past:
            # generate() passes the mask of every token so far at each step: a decoding step reads O(t) columns
            # for the check, not O(context), and an accelerator checks them without a host synchronisation
            msg = ("the tokens that continue a cache must be real (attention_mask 1 in its last T columns): padding "
                   "goes in the prompt, the forward that fills the cache")
            if new.device.type != "cpu":
                torch._assert_async(new.all(), msg)
            elif not bool(new.all()):
                raise ValueError(msg)
            if not cache.padded:  # the cached tokens' columns were read when they went in
                return None, None, position_ids
            if mask.shape[1] != past + t:
                raise ValueError(f"this cache holds padded rows: the attention_mask needs every token so far ([B, "
                                 f"{past + t}] columns), as generate() passes it; got {tuple(mask.shape)}")
            return None, mask.bool(), mask_positions(mask, t) if position_ids is None else position_ids
        if bool(new.all()):  # all ones (one host read): the plain forward
            return None, None, position_ids
        if cu_seqlens is not None:
            raise ValueError("pass either attention_mask with zeros (padded rows) or cu_seqlens (packed documents), "
                             "not both")
        return unpad_mask(new), None, position_ids

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cu_seqlens: torch.LongTensor | None = None,
        past_key_values: HiloCache | None = None,
        use_cache: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        cache: HiloCache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """Run the stack. cache (alias past_key_values) is a HiloCache; with use_cache and no cache, one is created
        (use_cache defaults to config.use_cache in eval mode and to False in training mode).

        position_ids default to cache length + arange(T), or restart per document when cu_seqlens is given.

        attention_mask [B, T] (or [B, P + T] after a cache that has consumed P tokens: what generate() passes) marks
        real tokens 1 and padding 0, on either side (docs/design.md, "Padded batches"). All ones is the plain
        forward, unchanged. With zeros, the real tokens run as packed documents, one per row (models/padding.py):
        outputs at the real tokens equal each row run alone, positions restart at each row's first real token, and
        the outputs at the pads are zeros. A cache filled by such a forward holds each row's own states; the
        forwards that continue it need the mask of every token so far, and their new tokens must be real.
        """
        if cache is None:
            cache = past_key_values
        elif past_key_values is not None and past_key_values is not cache:
            raise ValueError("pass the cache once: as cache or as past_key_values, not both")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if cache is not None and not isinstance(cache, HiloCache):
            raise TypeError(f"hilo models decode with models.HiloCache, got {type(cache).__name__}")
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.config.embed_dropout and self.training:
            hidden = F.dropout(hidden, self.config.embed_dropout, training=True)
        b, t = hidden.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        unpadded = key_mask = None  # a padded batch's packing, or the key mask of a forward continuing padded rows
        if attention_mask is not None:
            unpadded, key_mask, position_ids = self._read_mask(attention_mask.to(hidden.device), b, t, past, cache,
                                                               cu_seqlens, position_ids)
        elif past and cache.padded:
            raise ValueError(f"this cache holds padded rows: pass the attention_mask of every token so far ([B, "
                             f"{past + t}] columns), as generate() does")
        if use_cache is None:  # training forwards never build a decoding cache unless asked to
            use_cache = self.config.use_cache and not self.training
        if cu_seqlens is not None:
            if b != 1:
                raise ValueError(f"cu_seqlens needs packed inputs with batch size 1, got {b}")
            if cache is not None:
                raise ValueError("cu_seqlens (packed documents) cannot be combined with a decoding cache")
            use_cache = False
            if position_ids is None:
                position_ids = positions_from_cu_seqlens(cu_seqlens.to(hidden.device), t)
        if use_cache and cache is None:
            cache = HiloCache.from_config(self.config)
        if cache is not None and past == 0:
            cache.padded = unpadded is not None
        if unpadded is not None:
            # the real tokens as one packed row of documents, every mixer on its varlen path
            hidden = unpad(hidden, unpadded)
            cu_seqlens = unpadded.cu_seqlens
            if position_ids is None:
                position_ids = positions_from_cu_seqlens(cu_seqlens, hidden.shape[1])
            else:
                position_ids = unpad(position_ids.expand(b, t), unpadded)
            if cache is not None:
                cache.unpadded = unpadded
        if cache is not None and key_mask is not None:
            cache.key_mask = key_mask
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=hidden.device).unsqueeze(0).expand(b, t)
        all_hidden = [] if output_hidden_states else None
        # compiled single-token steps continue a cache (the first token, with empty slots, runs eagerly)
        if (self._decode_step is not None and cache is not None and past > 0 and t == 1 and cu_seqlens is None
                and all_hidden is None and not torch.is_grad_enabled()):
            cache.prepare_step(past + t)
            # CUDA graphs ("reduce-overhead"): a new step; the last one's outputs (consumed by then) may be reused
            torch.compiler.cudagraph_mark_step_begin()
            try:
                hidden = self._decode_step(hidden, position_ids, cache)
            finally:
                cache.step_prepared = False  # only this step may skip the cache's growth checks
            cache.advance(t)
            return BaseModelOutputWithPast(last_hidden_state=hidden, **{_CACHE_FIELD: cache if use_cache else None})
        for block in self.layers:
            if all_hidden is not None:
                all_hidden.append(hidden)
            if self.gradient_checkpointing and self.training and cache is None:
                hidden = self._gradient_checkpointing_func(block.__call__, hidden, position_ids, cu_seqlens, None)
            else:
                hidden = block(hidden, position_ids, cu_seqlens, cache)
        hidden = self.norm(hidden)
        if all_hidden is not None:
            all_hidden.append(hidden)
        if unpadded is not None:  # back to the rows' padded layout
            hidden = pad(hidden, unpadded)
            if all_hidden is not None:
                all_hidden = [pad(h, unpadded) for h in all_hidden]
        if cache is not None:
            cache.advance(t)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden,
            hidden_states=tuple(all_hidden) if all_hidden is not None else None,
            **{_CACHE_FIELD: cache if use_cache else None},
        )


class HiloForCausalLM(HiloPreTrainedModel, GenerationMixin):
    """HiloModel + LM head (optionally tied to the embeddings), next-token loss and generate().

    num_flops_per_token(seq_len) gives the training FLOPs per token used for MFU (see its docstring).
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"} if _TF_MAJOR >= 5 else ["lm_head.weight"]

    def __init__(self, config: HiloConfig):
        super().__init__(config)
        self.model = HiloModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def compile_decoding(self, mode: str | None = None, enabled: bool = True, backend="inductor") -> None:
        """Compile single-token cached decoding steps (HiloModel.compile_decoding): generate() and decode loops
        then run the layers compiled after the prompt."""
        self.model.compile_decoding(mode=mode, enabled=enabled, backend=backend)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate() must not build a DynamicCache: forward creates a HiloCache (recurrent mixers keep
        # states a DynamicCache cannot hold) and returns it, and generate passes it back each step.
        return False

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cu_seqlens: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        past_key_values: HiloCache | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        cache: HiloCache | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        return_logits: bool = True,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits [B, T', V] (T' = T, or the last logits_to_keep positions, or the given index tensor) and loss.

        labels [B, T] follow the HF convention: the model shifts them (logits at t predict labels[t + 1]) and
        ignores -100; the loss is the fp32 cross-entropy mean over the remaining targets (or their sum divided
        by num_items_in_batch when given, for gradient accumulation). With an attention_mask, labels at pads and
        at a row's first real token are ignored too, so a padded batch's loss is that of its rows packed. With
        cu_seqlens the first token of every document is never a target, so no loss term crosses a document
        boundary. return_logits=False (with labels: training steps that only read .loss) returns logits None and,
        unless config.fused_loss_chunk is None, computes the same loss with fused_loss, which never holds the logits
        of the whole batch. Other HF keyword arguments (output_attentions, return_dict, ...) are accepted and
        ignored: outputs are always ModelOutputs.
        """
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cu_seqlens=cu_seqlens,
            past_key_values=past_key_values,
            cache=cache,
            use_cache=use_cache,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
        )
        hidden = out.last_hidden_state
        loss = None
        if labels is not None and attention_mask is not None and attention_mask.shape == labels.shape:
            # padded rows: only the targets inside each row's own tokens count (models.padding.target_mask)
            labels = labels.masked_fill(~target_mask(attention_mask.to(labels.device)), IGNORE_INDEX)
        if labels is not None:
            if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
                raise ValueError("labels need logits at every position: leave logits_to_keep at 0")
            if return_logits or self.config.fused_loss_chunk is None:
                logits = self.lm_head(hidden)
                loss = self.loss(logits, labels, cu_seqlens, num_items_in_batch)
                if not return_logits:
                    logits = None
            else:
                logits = None
                loss = self.fused_loss(hidden, labels, cu_seqlens, num_items_in_batch)
        else:
            if isinstance(logits_to_keep, int):
                if logits_to_keep > 0:
                    hidden = hidden[:, -logits_to_keep:]
            else:
                hidden = hidden[:, logits_to_keep]
            logits = self.lm_head(hidden)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=out.hidden_states,
            **{_CACHE_FIELD: out.get(_CACHE_FIELD, None)},
        )

    @staticmethod
    def loss(
        logits: torch.Tensor,
        labels: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fp32 next-token cross-entropy of logits [B, T, V] against labels [B, T] (shifted here, -100 ignored)."""
        labels = labels.to(logits.device)
        if cu_seqlens is not None:
            labels = labels.clone()
            labels[0, cu_seqlens[1:-1].to(device=labels.device, dtype=torch.long)] = -100
        targets = labels[:, 1:].reshape(-1)
        flat = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
        if num_items_in_batch is None:
            return F.cross_entropy(flat, targets, ignore_index=-100)
        return F.cross_entropy(flat, targets, ignore_index=-100, reduction="sum") / num_items_in_batch

    def fused_loss(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """loss(lm_head(hidden), labels, cu_seqlens, num_items_in_batch) from the final hidden states [B, T, C]
        by models.loss.chunked_cross_entropy, config.fused_loss_chunk rows at a time."""
        labels = labels.to(hidden.device)
        if cu_seqlens is not None:
            labels = labels.clone()
            labels[0, cu_seqlens[1:-1].to(device=labels.device, dtype=torch.long)] = IGNORE_INDEX
        # position t predicts labels[t + 1]; the last position of each row predicts nothing. Padding the targets
        # (not slicing hidden) keeps hidden a view.
        no_target = torch.full_like(labels[:, :1], IGNORE_INDEX)
        targets = torch.cat([labels[:, 1:], no_target], dim=1).reshape(-1)
        hidden = hidden.reshape(-1, hidden.shape[-1])
        if self.config.loss_at_targets_only:
            rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)
            hidden, targets = hidden.index_select(0, rows), targets.index_select(0, rows)
        loss = chunked_cross_entropy(
            hidden, self.lm_head.weight, targets,
            chunk_size=self.config.fused_loss_chunk, reduction="mean" if num_items_in_batch is None else "sum")
        return loss if num_items_in_batch is None else loss / num_items_in_batch

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        past_key_values: HiloCache | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        use_cache: bool = True,
        logits_to_keep: int | None = None,
        **kwargs,
    ) -> dict:
        """Feed only the tokens the cache has not seen yet (all of them on the first step).

        generate() passes the cache as past_key_values (transformers < 5.2x) or as cache; both are accepted.
        """
        cache = kwargs.pop("cache", None)
        if cache is None:
            cache = past_key_values
        past = cache.get_seq_length() if cache is not None else 0
        model_inputs: dict = {"use_cache": use_cache, "cache": cache}
        if inputs_embeds is not None and past == 0:
            model_inputs["inputs_embeds"] = inputs_embeds
            new = inputs_embeds.shape[1]
        else:
            model_inputs["input_ids"] = input_ids[:, past:].contiguous()
            new = input_ids.shape[1] - past
        if position_ids is not None:
            model_inputs["position_ids"] = position_ids[:, -new:]
        if attention_mask is not None:
            model_inputs["attention_mask"] = attention_mask
        if logits_to_keep is not None:
            model_inputs["logits_to_keep"] = logits_to_keep
        return model_inputs

    def _reorder_cache(self, cache: HiloCache, beam_idx: torch.LongTensor) -> HiloCache:
        cache.reorder_cache(beam_idx)
        return cache

    def num_flops_per_token(self, seq_len: int) -> float:
        """Training (forward + backward) FLOPs per token at sequence length seq_len, for MFU.

        6 * N + sum over layers of Block.flops_per_token(seq_len), where N counts the weights of every nn.Linear
        (q/k/v/o and mixer projections, the MLPs and the LM head, counted even when tied; the embedding lookup and
        norms are not matmuls) and each mixer reports its own sequence-mixing cost (for softmax attention
        6 * num_heads * head_dim * seq_len, the causal 12 * H * D * seq_len / 2), plus the pre-mixer conv's
        6 * K * hidden_size when config.pre_conv = K. Works on meta-device models.
        """
        n_matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        mixing = sum(block.flops_per_token(seq_len) for block in self.model.layers)
        return float(6 * n_matmul + mixing)
