"""The T6 as a Hugging Face causal LM: `T6ForCausalLM` runs t6.model.t6.T6 itself, and `T6Cache`
holds each layer's own KVCache, allocated from its attention's `cache_spec` (TPA caches its factors,
MLA its latent, GQA its KV heads only), behind transformers' cache interface.

Every export carries this module, after the model's own sources, as modeling_t6.py (t6.hf.source),
so `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` computes T6.forward's logits
and `generate()` decodes through each mechanism's cached path, as T6.generate does.

Padding: right padding (lm-eval's batches) needs nothing, since no real position of a causal model
sees a later one; left padding (prompts of different lengths batched for generate) becomes the
caches' key mask, as in T6.generate, for the attentions that honour one.
"""

from __future__ import annotations

from dataclasses import fields

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

from t6.hf.configuration import T6Config
from t6.model.attention.base import KVCache
from t6.model.config import ModelConfig
from t6.model.layers import Rotary
from t6.model.t6 import T6


def to_model_config(config: T6Config) -> ModelConfig:
    """The ModelConfig of a T6Config: the ModelConfig fields it holds, ModelConfig's defaults for the others."""
    return ModelConfig(**{f.name: getattr(config, f.name) for f in fields(ModelConfig) if hasattr(config, f.name)})


class T6CacheLayer(CacheLayerMixin):
    """One layer's KVCache, allocated once at its full length; the attention writes it in place
    (KVCache.update), this layer counts the tokens it holds."""

    is_croppable = True

    def __init__(self, kv: KVCache):
        super().__init__()
        self.kv = kv
        self.length = 0  # tokens cached
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the cache was allocated with the layer."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise NotImplementedError("a T6 attention writes its own cache (KVCache.update), not keys and values")

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.kv.max_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def reset(self) -> None:
        for tensor in self.kv.tensors.values():
            tensor.zero_()
        self.kv.key_mask, self.length = None, 0

    def crop(self, tokens_to_remove: int) -> None:
        self.length = max(0, self.length - tokens_to_remove)  # later writes overwrite the removed tokens

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.kv = self.kv.select(indices.to(next(iter(self.kv.tensors.values())).device))  # rows [B']

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = next(iter(self.kv.tensors.values())).shape[0]
        self.batch_select_indices(torch.arange(rows).repeat_interleave(repeats))  # [B * repeats]


class T6Cache(Cache):
    """The caches of a T6's layers for `batch_size` sequences of up to `max_len` tokens, each holding
    what its attention declares (`cache_spec`), in the model's dtype and on its device."""

    def __init__(self, model: T6, batch_size: int, max_len: int, dtype=None, device=None):
        super().__init__(layers=[T6CacheLayer(kv) for kv in model.build_kv_caches(batch_size, max_len, dtype, device)])

    def kv_caches(self) -> list[KVCache]:
        return [layer.kv for layer in self.layers]

    def advance(self, tokens: int) -> None:
        for layer in self.layers:
            layer.length += tokens

    def mask_keys(self, mask: torch.Tensor) -> None:
        """mask: bool [B, S], False at the padding of the first S positions (the later ones are real)."""
        max_len = self.layers[0].kv.max_len
        key_mask = torch.ones(mask.shape[0], max_len, dtype=torch.bool, device=mask.device)  # [B, max_len]
        key_mask[:, : mask.shape[1]] = mask
        for layer in self.layers:
            layer.kv.key_mask = key_mask


class T6ForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = T6Config
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}  # applied when tie_embeddings

    def __init__(self, config: T6Config):
        super().__init__(config)
        self.model = T6(to_model_config(config))
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: torch.nn.Module) -> None:
        """The rotary tables (buffers, not weights: transformers builds the model on the meta device and
        loads only the weights); every weight comes from the checkpoint or T6's own initialization."""
        if isinstance(module, Rotary):
            table = Rotary(module.dim, module.max_len, module.theta)
            module.cos.copy_(table.cos)  # [max_len, dim/2]
            module.sin.copy_(table.sin)  # [max_len, dim/2]

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.model.embed

    def set_input_embeddings(self, value: torch.nn.Embedding) -> None:
        self.model.embed = value

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.model.lm_head

    def build_cache(self, batch_size: int, max_len: int | None = None) -> T6Cache:
        """Caches for batch_size sequences of up to max_len tokens (default: the model's block_size)."""
        return T6Cache(self.model, batch_size, min(max_len or self.config.block_size, self.config.block_size))

    def padding_mask(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """attention_mask [B, S] (1: token, 0: padding) -> bool [B, S] when a row has padding before one
        of its tokens (left padding), checked against the attention; None otherwise (no padding, or
        padding after the tokens only, which a causal model never attends to from a real position)."""
        if attention_mask is None:
            return None
        mask = attention_mask.to(torch.bool)  # [B, S]
        if not bool((~mask[:, :-1] & mask[:, 1:]).any()):
            return None
        try:
            return self.model.check_prompt_mask(mask, mask.shape)
        except ValueError as err:
            raise ValueError(f"attention_mask: {err}") from None

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        cache: T6Cache | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """input_ids [B, T] follow the cache's tokens (none without a cache) -> logits [B, T, vocab],
        T6.forward's; labels [B, T] give the mean next-token loss (shifted here, -100 ignored);
        use_cache=True without a cache starts one of block_size tokens."""
        B, T = input_ids.shape
        if cache is not None and not isinstance(cache, T6Cache):
            raise TypeError(
                f"cache is a {type(cache).__name__}; a T6 caches what its attention declares: pass the cache a "
                "previous call returned, model.build_cache(batch_size), or none"
            )
        if cache is None and use_cache:
            cache = self.build_cache(B)
        start = 0 if cache is None else cache.get_seq_length()
        padding = self.padding_mask(attention_mask)  # [B, start + T] or None
        step_cache = cache if cache is not None or padding is None else self.build_cache(B, T)
        if padding is not None:
            step_cache.mask_keys(padding)
        logits = self.model(input_ids, start, None if step_cache is None else step_cache.kv_caches())  # [B, T, V]
        if cache is not None:
            cache.advance(T)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)
        return out if return_dict is not False else out.to_tuple()

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs: dict, generation_mode, batch_size: int, max_cache_length: int
    ) -> None:
        """generate()'s cache: a T6Cache for every sequence it decodes, unless the caller gave one."""
        if model_kwargs.get("cache") is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
            )
        if generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(
                f"cache_implementation={generation_config.cache_implementation!r}: a T6 caches what its attention "
                "declares (T6Cache); leave cache_implementation unset"
            )
        rows = batch_size * max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        model_kwargs["cache"] = self.build_cache(rows, max_cache_length)
