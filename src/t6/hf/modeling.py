"""The T6 as a Hugging Face causal LM: `T6ForCausalLM` runs t6.model.t6.T6 itself, and `T6Cache`
holds each layer's own KVCache, allocated from its attention's `cache_spec` (TPA caches its factors,
MLA its latent, GQA its KV heads only), behind transformers' cache interface.

Every export carries this module as modeling_t6.py beside the model's own files (t6.hf.export), so
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` computes T6.forward's logits and
`generate()` decodes through each mechanism's cached path, as T6.generate does.

Calls take what transformers' own causal LMs take (transformers 5.24's LlamaForCausalLM):
- `cache` (or its former name `past_key_values`): a T6Cache a previous call returned, grown as tokens
  arrive; `use_cache` (default: the config's `use_cache`, off in training mode) starts one;
- `attention_mask` [B, cached + new tokens], any pattern of 1 (token) and 0 (padding): the caches'
  key mask, so no token attends to a padding position (left, right or in between). A token's position
  is its index in the sequence: RoPE scores depend on distances only, so a left-padded row computes
  what it would alone, and a gap keeps its width; `position_ids` may shift a row by a constant, no more;
- `inputs_embeds` instead of `input_ids`, `labels` (the shifted causal-LM loss), `logits_to_keep`,
  `output_hidden_states` (the embeddings, then each block's output, the last one normalized),
  `output_attentions` (each layer's softmax probabilities [B, h, T, S], computed explicitly while asked).
"""

from __future__ import annotations

from dataclasses import fields

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging
from transformers.utils.deprecation import deprecate_kwarg

from t6.hf.configuration import T6Config
from t6.model.attention.base import Attention, KVCache
from t6.model.config import ConfigError, ModelConfig
from t6.model.layers import Rotary, SwiGLU
from t6.model.t6 import T6, Block

logger = logging.get_logger(__name__)

# transformers' attn_implementation -> what a T6 runs. Each mechanism is its own attention, so these name T6's two
# ways of computing it, not transformers' attention functions:
ATTN_IMPLEMENTATIONS = {
    # each mechanism's own kernels (the default): PyTorch's SDPA and the fused decode operators
    "sdpa": "sdpa",
    # the attention written out in PyTorch operations (scores, softmax, weighted sum), as output_attentions has it
    "eager": "eager",
    # TRL's and lm-eval's usual choice: SDPA, whose FlashAttention backend runs on CUDA in fp16/bf16 (no flash-attn)
    **{f"flash_attention_{version}": "sdpa" for version in (2, 3, 4)},
}


def t6_attn_implementation(asked: str | None) -> str:
    """The attn_implementation a T6 runs for the one asked (None: the default, "sdpa"): ATTN_IMPLEMENTATIONS. Any
    other (transformers' flex or paged attention, a kernel from the Hub) is an error naming it."""
    name = "sdpa" if asked is None else asked
    if name not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f'Specified `attn_implementation="{name}"` is not supported by a T6: each mechanism computes its own '
            "attention, with its own kernels (sdpa, the default) or written out (eager); flash_attention_2, _3 and _4 "
            f"run as sdpa. Choose one of {', '.join(ATTN_IMPLEMENTATIONS)}"
        )
    return ATTN_IMPLEMENTATIONS[name]


class Unkept(list):
    """Attention.recorded that keeps nothing: the attention is computed written out, its probabilities dropped."""

    def append(self, probs: torch.Tensor) -> None:
        pass


def to_model_config(config: T6Config) -> ModelConfig:
    """The ModelConfig of a T6Config: the ModelConfig fields it holds, ModelConfig's defaults for the others. A field
    of the wrong type or value (config.json edited by hand) is an error naming it, before anything is built."""
    try:
        return ModelConfig(**{f.name: getattr(config, f.name) for f in fields(ModelConfig) if hasattr(config, f.name)})
    except ConfigError as err:
        where = f"{config.name_or_path}/config.json" if config.name_or_path else "T6Config"
        raise ConfigError(f"{where} does not describe a T6", err.problems) from None


def resized(kv: KVCache, max_len: int) -> KVCache:
    """A KVCache of max_len positions holding kv's tokens: the same quantities, layout, dtype and device."""
    first = next(iter(kv.tensors.values()))
    head_major = tuple(name for name, dim in kv.seq_dims.items() if dim == 2)
    out = KVCache(kv.spec, first.shape[0], max_len, first.dtype, first.device, head_major)
    for name, tensor in kv.tensors.items():
        dim = kv.seq_dims[name]
        keep = min(kv.max_len, max_len)
        out.tensors[name].narrow(dim, 0, keep).copy_(tensor.narrow(dim, 0, keep))  # [B, ..., keep, ...]
    return out


class T6CacheLayer(CacheLayerMixin):
    """One layer's KVCache, written in place by its attention `attn` (KVCache.update); this layer counts the tokens
    it holds and grows the KVCache when a call brings more than it has room for.

    `keys` and `values` are transformers' view of it, [B, h_kv, tokens, d_k] and [B, h_kv, tokens, d_v], as the
    attention scores and averages them (Attention.cached_keys_values): for a K/V cache (MHA, GQA, MQA; GTA's values)
    the cached tensors themselves; for factors or latents (TPA's factors, MLA's and GLA's latents, ...) computed from
    them at each read, a new tensor that decoding never reads (writing into it changes nothing)."""

    is_croppable = True

    def __init__(self, kv: KVCache, attn: Attention):
        # CacheLayerMixin.__init__ would set keys and values, which are read from the KVCache here
        self.kv, self.attn = kv, attn
        self.length = 0  # tokens cached
        self.is_initialized = True

    @property
    def keys(self) -> torch.Tensor:
        return self.attn.cached_keys_values(self.kv, self.length)[0]  # [B, h_kv, tokens, d_k]

    @property
    def values(self) -> torch.Tensor:
        return self.attn.cached_keys_values(self.kv, self.length)[1]  # [B, h_kv, tokens, d_v]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the cache was allocated with the layer."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise NotImplementedError("a T6 attention writes its own cache (KVCache.update), not keys and values")

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # it grows (up to the model's block_size)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def reserve(self, tokens: int, limit: int) -> None:
        """Room for `tokens` tokens: a KVCache twice as long (at least `tokens`, at most `limit` unless more are
        asked) holding the same ones, when this one is shorter."""
        if tokens > self.kv.max_len:
            self.kv = resized(self.kv, max(tokens, min(2 * self.kv.max_len, limit)))

    def reset(self) -> None:
        for tensor in self.kv.tensors.values():
            tensor.zero_()
        self.kv.key_mask, self.length = None, 0

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last -tokens_to_remove tokens (transformers' convention: a count <= 0); later writes
        overwrite them."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): give the number of tokens to remove as a negative count")
        self.length = max(0, self.length + tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.kv = self.kv.select(indices.to(next(iter(self.kv.tensors.values())).device))  # rows [B']

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = next(iter(self.kv.tensors.values())).shape[0]
        self.batch_select_indices(torch.arange(rows).repeat_interleave(repeats))  # [B * repeats]


class T6Cache(Cache):
    """The caches of a T6's layers for `batch_size` sequences, room for `max_len` tokens to start with (they
    grow up to the model's block_size), each holding what its attention declares (`cache_spec`), in the
    model's dtype and on its device."""

    def __init__(self, model: T6, batch_size: int, max_len: int, dtype=None, device=None):
        self.block_size = model.cfg.block_size
        caches = model.build_kv_caches(batch_size, max_len, dtype, device)
        super().__init__(layers=[T6CacheLayer(kv, block.attn) for kv, block in zip(caches, model.blocks)])

    def kv_caches(self) -> list[KVCache]:
        return [layer.kv for layer in self.layers]

    def reserve(self, tokens: int) -> None:
        for layer in self.layers:
            layer.reserve(tokens, self.block_size)

    def advance(self, tokens: int) -> None:
        for layer in self.layers:
            layer.length += tokens

    def mask_keys(self, mask: torch.Tensor | None) -> None:
        """mask: bool [B, S], False at the padding among the first S positions (later ones are tokens), or None."""
        key_mask = None
        if mask is not None:
            key_mask = torch.ones(mask.shape[0], self.layers[0].kv.max_len, dtype=torch.bool, device=mask.device)
            key_mask[:, : mask.shape[1]] = mask  # [B, max_len]
        for layer in self.layers:
            layer.kv.key_mask = key_mask


class T6DecoderLayer(Block, GradientCheckpointingLayer):
    """A T6 block as transformers' GradientCheckpointingLayer: `gradient_checkpointing_enable()` has it recomputed
    in backward by transformers' checkpoint function, with its `gradient_checkpointing_kwargs` (use_reentrant) and
    `every_n_layers`. The block itself, its weights and their names are T6's `Block`."""


def run_block(block: T6DecoderLayer, *args) -> torch.Tensor:
    """T6Backbone's checkpoint function: the block, which checkpoints itself when transformers says so."""
    return block(*args)


class T6Backbone(T6):
    """The T6 of the export, its blocks T6DecoderLayer. transformers sets every `gradient_checkpointing` flag it
    finds, T6's own as well; here the blocks recompute themselves, so T6's checkpoint function only runs them."""

    block_class = T6DecoderLayer

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.checkpoint_function = run_block


class T6ForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = T6Config
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _supports_sdpa = True  # attn_implementation="sdpa", the default (ATTN_IMPLEMENTATIONS)
    _no_split_modules = ["T6DecoderLayer"]
    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}  # applied when tie_embeddings

    def __init__(self, config: T6Config):
        t6_attn_implementation(config._attn_implementation)  # refused before transformers looks for a Hub kernel
        super().__init__(config)
        self.model = T6Backbone(to_model_config(config))
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """T6's own initialization (T6.init_weights), module by module, for what transformers has not loaded (its
        guard on torch.nn.init skips loaded tensors): each attention its own way (Attention.init_weights: N(0,
        init_std), Xavier on TPA's factor maps, a zero output projection), SwiGLU N(0, init_std) with a zero down
        projection, the embedding and an untied head N(0, init_std), norms ones; the rotary tables (buffers,
        made on the meta device when transformers loads a model) are rebuilt."""
        std = self.config.init_std
        if isinstance(module, Attention):
            module.init_weights()
        elif isinstance(module, SwiGLU):
            nn.init.normal_(module.gate.weight, std=std)
            nn.init.normal_(module.up.weight, std=std)
            nn.init.zeros_(module.down.weight)
        elif isinstance(module, nn.Embedding) or module is self.model.lm_head:
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, nn.RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, Rotary):
            table = Rotary(module.dim, module.max_len, module.theta, module.scaling)  # Llama 3's remap too
            module.cos.copy_(table.cos)  # [max_len, dim/2]
            module.sin.copy_(table.sin)  # [max_len, dim/2]

    def _initialize_weights(self, module: nn.Module, is_custom_code: bool = False) -> None:
        """transformers' own, less its shortcut for remote code, which passes over a module without parameters of
        its own: an attention or a SwiGLU initializes its layers itself (`_init_weights`)."""
        super()._initialize_weights(module, is_custom_code=False)

    def mark_tied_weights_as_initialized(self, loading_info) -> None:
        """transformers marks the tied head as loaded, as the embedding will fill it; a T6's head *is* its
        embedding (one parameter), so that would also hide a missing embedding: only when the embedding is there."""
        if not any(source in loading_info.missing_keys for source in self.all_tied_weights_keys.values()):
            super().mark_tied_weights_as_initialized(loading_info)

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        """transformers' check of an attn_implementation (at load, and by set_attn_implementation): the one a T6 runs
        (t6_attn_implementation), which transformers records in the config."""
        runs = t6_attn_implementation(requested_attention)
        if requested_attention not in (None, runs):
            logger.warning_once(
                f"attn_implementation={requested_attention!r}: a T6 runs its own kernels, recorded as {runs!r} "
                "(PyTorch's SDPA, whose FlashAttention backend runs on CUDA in fp16/bf16; no flash-attn package needed)"
            )
        return runs

    def set_attn_implementation(self, attn_implementation: str | dict, allow_all_kernels: bool = False) -> None:
        """transformers' own, the implementation checked first (a kernel from the Hub is refused before it is looked
        for)."""
        asked = attn_implementation.get("") if isinstance(attn_implementation, dict) else attn_implementation
        if asked is not None:
            t6_attn_implementation(asked)
        super().set_attn_implementation(attn_implementation, allow_all_kernels)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.model.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.model.lm_head = value

    def build_cache(self, batch_size: int, max_len: int | None = None) -> T6Cache:
        """Caches for batch_size sequences, room for max_len tokens (default: the model's block_size)."""
        return T6Cache(self.model, batch_size, min(max_len or self.config.block_size, self.config.block_size))

    @staticmethod
    def key_mask(attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
        """attention_mask [B, length] (1: token, 0: padding, for the cached and the new tokens) -> bool [B, length],
        or None when it masks nothing."""
        if attention_mask is None:
            return None
        if attention_mask.dim() != 2 or attention_mask.shape[1] != length:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}; a T6 takes a 2D mask [batch, cached + new "
                f"tokens] = [{attention_mask.shape[0]}, {length}] (1: token, 0: padding)"
            )
        mask = attention_mask.to(torch.bool)  # [B, length]
        return None if bool(mask.all()) else mask

    @staticmethod
    def check_positions(position_ids: torch.Tensor | None, mask: torch.Tensor | None, start: int, T: int) -> None:
        """position_ids [B or 1, T] may shift each row's positions start..start+T-1 by a constant over its tokens
        (RoPE scores depend on distances only, so a left-padded row counted from its first token computes the
        same); anything else would change distances the T6 keeps."""
        if position_ids is None:
            return
        shift = position_ids.to(torch.long) - torch.arange(start, start + T, device=position_ids.device)  # [B, T]
        same = shift == shift[:, -1:]  # [B, T], against the row's last (newest) token
        if mask is not None:
            same = same | ~mask[:, -T:]  # padding positions carry any position
        if not bool(same.all()):
            raise ValueError(
                "position_ids: a T6 places each token at its index in the sequence (cached tokens first); a row's "
                "positions may be shifted by a constant, but these change the distances between its tokens. Pass "
                "the tokens with an attention_mask (0 at padding) and no position_ids"
            )

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: T6Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """input_ids [B, T] (or inputs_embeds [B, T, d]) follow the cache's tokens (none without a cache) ->
        logits [B, T, vocab] (the last logits_to_keep positions when > 0), T6.forward's; labels [B, T] give the
        mean next-token loss (shifted here, -100 ignored)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids [B, T] and inputs_embeds [B, T, d_model]")
        if cache is not None and not isinstance(cache, T6Cache):
            raise TypeError(
                f"cache is a {type(cache).__name__}; a T6 caches what its attention declares: pass the cache a "
                "previous call returned, model.build_cache(batch_size), or none"
            )
        config = self.config
        use_cache = (config.use_cache and not self.training) if use_cache is None else use_cache
        output_attentions = config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = config.output_hidden_states if output_hidden_states is None else output_hidden_states
        return_dict = config.return_dict if return_dict is None else return_dict

        x = self.model.embed(input_ids) if inputs_embeds is None else inputs_embeds  # [B, T, d]
        B, T = x.shape[:2]
        if cache is None and use_cache:
            cache = self.build_cache(B, T)
        start = 0 if cache is None else cache.get_seq_length()
        padding = self.key_mask(attention_mask, start + T)  # [B, start + T] or None
        self.check_positions(kwargs.pop("position_ids", None), padding, start, T)
        step = cache if cache is not None or padding is None else self.build_cache(B, T)  # the mask lives in caches
        if step is not None:
            step.reserve(start + T)
            step.mask_keys(padding)

        # The attention is written out (Attention.recorded a list) for output_attentions and for eager
        # (ATTN_IMPLEMENTATIONS), its probabilities kept only when asked for. A block that gradient checkpointing
        # recomputes in backward runs after this call and must compute as it did here: the way stays until the next.
        attns = [block.attn for block in self.model.blocks]
        written_out = output_attentions or config._attn_implementation == "eager"
        for attn in attns:
            attn.recorded = [] if output_attentions else Unkept() if written_out else None
        try:
            states = [x]  # the embeddings, then each block's output
            for h in self.model.hidden_states(x, start, None if step is None else step.kv_caches()):
                states = [*states, h] if output_hidden_states else [h]
            attentions = self.recorded_attentions(attns) if output_attentions else None
        finally:
            for attn in attns:
                attn.recorded = Unkept() if written_out else None
        if cache is not None:
            cache.advance(T)
        final = self.model.norm(states[-1])  # [B, T, d]
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.model.lm_head(final[:, keep])  # [B, T or kept, vocab]
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=config.vocab_size, **kwargs)
        out = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=cache,
            hidden_states=(*states[:-1], final) if output_hidden_states else None,
            attentions=attentions,
        )
        return out if return_dict else out.to_tuple()

    def recorded_attentions(self, attns: list[nn.Module]) -> tuple[torch.Tensor, ...]:
        """Each layer's attention probabilities [B, h, T, S] recorded during the forward (Attention.recorded)."""
        missing = sorted({type(a).__name__ for a in attns if len(a.recorded) != 1})
        if missing:
            raise NotImplementedError(
                f"output_attentions: attention={self.config.attention!r} ({', '.join(missing)}) does not record its "
                "attention weights (Attention.recorded); call without output_attentions"
            )
        return tuple(a.recorded[0] for a in attns)

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs: dict, generation_mode, batch_size: int, max_cache_length: int
    ) -> None:
        """generate()'s cache: a T6Cache for every sequence it decodes, room for the whole generation, unless
        the caller gave one (it grows as needed). A generation that would pass the model's block_size is refused
        here, before its first step."""
        total, new = generation_config.max_length, generation_config.max_new_tokens
        if total > self.config.block_size:
            asked = f"prompt ({total - new} tokens) + max_new_tokens ({new})" if new is not None else "max_length"
            raise ValueError(
                f"generate(): {asked} = {total} tokens exceeds the model's block_size (max_position_embeddings) "
                f"{self.config.block_size}; lower max_new_tokens or shorten the prompt"
            )
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
