"""The T6 backbone (paper §3.6): a LLaMA-style decoder whose attention is chosen by name.

x = embed(tokens)
for each of the L blocks:  x += Attn(RMSNorm(x));  x += SwiGLU(RMSNorm(x))
logits = RMSNorm(x) @ embed^T          (tied embedding / LM head)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from t6.errors import SettingError
from t6.model.attention import KVCache, get_attention_class
from t6.model.attention.base import plain_linear
from t6.model.config import ModelConfig
from t6.model.fallback import enabled, fell_back
from t6.model.layers import SwiGLU
from t6.model.loss import IGNORE_INDEX, linear_cross_entropy
from t6.model.static_decode import StaticDecoder, auto_decoder


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = get_attention_class(cfg.attention)(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.ffn = SwiGLU(cfg.d_model, cfg.ffn_hidden)
        self.compiled: CompiledLayers | None = None  # `layers` compiled (T6.compile_blocks), for calls without a cache

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        if cache is None and self.compiled is not None:
            return self.compiled(x, pos)  # [B, T, d]
        return self.layers(x, pos, cache)  # [B, T, d]

    def layers(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """The block itself, never compiled: x [B, T, d] -> [B, T, d]."""
        x = x + self.attn(self.attn_norm(x), pos, cache)  # [B, T, d]
        return x + self.ffn(self.ffn_norm(x), None if cache is None else cache.stacked.get("gate_up"))  # [B, T, d]


def eager_backward_compile():
    """AOTAutograd compiles the backward with the forward inside this context (torch >= 2.8; a no-op before)."""
    config = torch._functorch.config
    if not hasattr(config, "force_non_lazy_backward_lowering"):
        return contextlib.nullcontext()
    return config.patch(force_non_lazy_backward_lowering=True)


class CompiledLayers:
    """A block's `layers` compiled (T6.compile_blocks), with the eager block as its fallback: a call that fails
    to compile (or to run compiled) warns once, is recorded (t6.model.fallback "compile") and runs eagerly, and every
    later call of every block runs eagerly. The first call of each input signature compiles the backward as
    well as the forward (AOTAutograd otherwise compiles it at the first backward, outside this guard)."""

    def __init__(self, layers: Callable, backend="inductor"):
        self.eager = layers
        self.compiled = torch.compile(layers, fullgraph=True, dynamic=False, backend=backend)
        self.seen: set[tuple] = set()  # input signatures compiled and run once

    def __call__(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if enabled("compile"):
            key = (x.shape, x.dtype, torch.is_grad_enabled(), torch.is_autocast_enabled(x.device.type))
            try:
                if key in self.seen:
                    return self.compiled(x, pos)  # [B, T, d]
                with eager_backward_compile():
                    y = self.compiled(x, pos)  # [B, T, d]
                self.seen.add(key)
                return y
            except Exception as err:
                fell_back("compile", err)
        return self.eager(x, pos)  # [B, T, d]


class T6(nn.Module):
    # The class of every block: Block, or a subclass of it (the Hugging Face export's blocks are transformers'
    # checkpointing layers, t6.hf.modeling.T6DecoderLayer); the weights and their names are the same.
    block_class: type[Block] = Block

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(self.block_class(cfg) for _ in range(cfg.n_layer))
        for depth, block in enumerate(self.blocks):  # a mechanism may depend on its layer's index (DIFF's lambda_init)
            block.attn.depth = depth
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.init_weights()
        # Recompute each block's activations in backward instead of keeping them (less memory, one more forward
        # of every block): training's `gradient_checkpointing` option; transformers' gradient_checkpointing_enable()
        # sets the flag of that name. Only where gradients flow; checkpoint_function runs a block that way.
        self.gradient_checkpointing = False
        self.checkpoint_function: Callable = functools.partial(checkpoint, use_reentrant=False)
        # generate's fixed-shape decoders by (batch size, cache dtype, device), kept with their caches and
        # compiled graphs for later generations; clear() frees them
        self.static_decoders: dict[tuple, StaticDecoder] = {}

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, init_std) for the embedding and the SwiGLU projections, zeros for the SwiGLU down
        projection (each residual branch starts at zero, so each block starts as the identity),
        ones for norms; each attention initializes its own layers (`Attention.init_weights`)."""
        nn.init.normal_(self.embed.weight, std=self.cfg.init_std)
        for block in self.blocks:
            for lin in (block.ffn.gate, block.ffn.up):
                nn.init.normal_(lin.weight, std=self.cfg.init_std)
            nn.init.zeros_(block.ffn.down.weight)
            nn.init.ones_(block.attn_norm.weight)
            nn.init.ones_(block.ffn_norm.weight)
            block.attn.init_weights()
        nn.init.ones_(self.norm.weight)
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, std=self.cfg.init_std)

    def forward(
        self,
        idx: torch.Tensor,
        start_pos: int = 0,
        caches: list[KVCache] | None = None,
        targets: torch.Tensor | None = None,
        loss_chunk_tokens: int | None = 1024,
        loss_impl: str = "auto",
    ) -> torch.Tensor:
        """idx [B, T] token ids at positions start_pos..start_pos+T-1 -> logits [B, T, vocab];
        with targets [B, T], the mean next-token cross-entropy [] instead, through the head in
        chunks of loss_chunk_tokens tokens so the full logits never exist (t6.model.loss; None:
        all logits at once; loss_impl: "auto" runs Liger-Kernel's fused kernel on CUDA, "chunked" never)."""
        x = self.embed(idx)  # [B, T, d]
        for x in self.hidden_states(x, start_pos, caches):  # [B, T, d] after each block
            pass
        if targets is not None:
            return self.loss(self.norm(x), targets, loss_chunk_tokens, loss_impl)  # []
        return self.lm_head(self.norm(x))  # [B, T, vocab]

    def hidden_states(self, x: torch.Tensor, start_pos: int = 0, caches: list[KVCache] | None = None):
        """The blocks on x [B, T, d] (embedded tokens at positions start_pos..start_pos+T-1): yields each block's
        output [B, T, d], the last one the final hidden state before the norm."""
        T = x.shape[1]
        if start_pos + T > self.cfg.block_size:
            raise SettingError(
                f"sequence reaches position {start_pos + T - 1} but the model's block_size is {self.cfg.block_size}; "
                "truncate the input or use a model with a larger size.block_size"
            )
        pos = torch.arange(start_pos, start_pos + T, device=x.device)  # [T]
        for cache in caches or ():
            cache.expect(pos, start_pos + T)  # the caches' new length, known here without a device sync
        recompute = self.gradient_checkpointing and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            cache = None if caches is None else caches[i]
            x = self.checkpoint_function(block, x, pos, cache) if recompute else block(x, pos, cache)  # [B, T, d]
            yield x

    def loss(self, h: torch.Tensor, targets: torch.Tensor, chunk_tokens: int | None, impl: str) -> torch.Tensor:
        """Mean next-token cross-entropy of the head on the normalized hidden states h [B, T, d] against targets
        [B, T] (t6.model.loss, in chunks); a wrapped head (a LoRA adapter) is called as a module instead."""
        if plain_linear(self.lm_head):
            return linear_cross_entropy(h, self.lm_head.weight, targets, chunk_tokens, impl)  # []
        logits = self.lm_head(h).float()  # [B, T, vocab]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)  # []

    def prefill(self, idx: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """Write the prompts idx [B, T] at positions 0..T-1 into the caches -> logits [B, vocab] at the last
        position: the LM head runs there only (at 32k tokens x batch 16 the full logits would take 52.8 GB in
        bf16)."""
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise SettingError(
                f"a prompt of {T} tokens exceeds the model's block_size {self.cfg.block_size}; truncate it"
            )
        pos = torch.arange(T, device=idx.device)  # [T]
        for cache in caches:
            cache.expect(pos, T)
        x = self.embed(idx)  # [B, T, d]
        for block, cache in zip(self.blocks, caches):
            x = block(x, pos, cache)  # [B, T, d]
        return self.lm_head(self.norm(x[:, -1]))  # [B, vocab]

    def decode_step(
        self, idx: torch.Tensor, pos: torch.Tensor, caches: list[KVCache], layer: Callable | None = None
    ) -> torch.Tensor:
        """idx [B, 1] at the position pos [1], a device tensor never read on the host, against caches in
        fixed-shape mode (KVCache.static_len) -> logits [B, vocab]. Its shapes do not depend on the
        position, so it compiles once per cache length and replays as a CUDA graph (t6.model.static_decode).
        layer(block, x, pos, cache) runs each block where given (a compiled block step), else the block does."""
        x = self.embed(idx)  # [B, 1, d]
        lengths = caches[0].count(pos)  # [B]: each row's cached tokens, computed once for every layer
        for cache in caches:
            cache.share_lengths(pos, lengths)
        for block, cache in zip(self.blocks, caches):
            x = block(x, pos, cache) if layer is None else layer(block, x, pos, cache)  # [B, 1, d]
        return self.lm_head(self.norm(x))[:, -1]  # [B, vocab]

    def cache_dtype(self, device: torch.device | str | None = None) -> torch.dtype:
        """What the layers compute, so what a cache holds: the autocast dtype under autocast (e.g.
        evaluation during bf16-mixed training), else the parameters' dtype."""
        device = torch.device(device or self.embed.weight.device)
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.embed.weight.dtype

    def compile_blocks(self, backend: str = "inductor") -> None:
        """torch.compile every block for calls without a KV cache (training, validation, the benchmarks):
        one graph, shared by all blocks (the same code, their parameters the graph's inputs), whole
        (fullgraph: a graph break is an error) and for fixed shapes (dynamic=False: a new shape compiles
        a graph of its own, never a dynamic one). The embedding and the loss stay outside (the loss runs
        its own kernels, t6.model.loss); calls with a cache (generation) and `Block.layers` stay eager,
        their shapes changing at every call. Compiling each block rather than the model lets DDP's
        gradient all-reduce and FSDP's all-gathers overlap the other blocks' work. Parameter names and
        checkpoints are unchanged. Where compiling fails, the blocks run eagerly (CompiledLayers)."""
        for block in self.blocks:
            block.compiled = CompiledLayers(block.layers, backend)

    def build_kv_caches(self, batch_size: int, max_len: int | None = None, dtype=None, device=None) -> list[KVCache]:
        """One cache per layer, allocated once; each attention decides what it stores, in `cache_dtype`
        unless dtype is given."""
        max_len = max_len or self.cfg.block_size
        device = torch.device(device or self.embed.weight.device)
        dtype = dtype or self.cache_dtype(device)
        return [block.attn.build_kv_cache(batch_size, max_len, dtype, device) for block in self.blocks]

    def static_decoder(self, batch_size: int, compile: bool = False) -> StaticDecoder:
        """The fixed-shape decoder `generate` uses for this batch size (made on first use, then kept); compile:
        its step compiled by inductor (t6.model.static_decode.FixedStep)."""
        device = self.embed.weight.device
        key = (batch_size, self.cache_dtype(device), device, compile)
        if key not in self.static_decoders:
            self.static_decoders[key] = StaticDecoder(self, batch_size, dtype=key[1], compile=compile)
        return self.static_decoders[key]

    def num_params(self, non_embedding: bool = False) -> int:
        """Distinct parameters (the tied head counts once); non_embedding excludes the token embedding."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if non_embedding else n

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        stop_tokens: tuple[int, ...] = (),
        generator: torch.Generator | None = None,
        prompt_mask: torch.Tensor | None = None,
        decode: str | StaticDecoder = "auto",
    ) -> torch.Tensor:
        """Prefill the prompts idx [B, T0] once, then decode one token at a time from the KV caches.

        Prompts of different lengths are left-padded to T0 (see `left_pad`), with prompt_mask
        [B, T0] bool marking the real tokens; no attention ever looks at a padding position,
        and since attention scores depend only on relative positions (RoPE), a padded row
        computes what it would alone. temperature=0 is greedy. Rows that produced a stop token
        keep emitting it. Returns [B, T0 + n] (padding included), n <= max_new_tokens.

        decode: "eager" (caches of exactly T0 + max_new_tokens positions, shapes growing with each
        token: the fastest on the CPU, through the fused C++ decode operators), "static" (the model's
        `static_decoder`: fixed shapes, each cache bucket's step captured as a CUDA graph on CUDA and
        replayed), "compiled" (static, the step compiled by inductor before its capture: fewer kernels per
        step, tens of seconds of compiling per bucket), "auto" (static on CUDA from GRAPH_MIN_NEW_TOKENS new
        tokens on, eager otherwise), or a StaticDecoder of batch size B. All give the same tokens (in bf16,
        up to ties within rounding: their kernels round in different orders).
        """
        B, T0 = idx.shape
        total = T0 + max_new_tokens
        if total > self.cfg.block_size:
            raise SettingError(
                f"prompt ({T0}) + max_new_tokens ({max_new_tokens}) = {total} exceeds block_size {self.cfg.block_size}"
            )
        check_sampling(temperature, top_k, top_p)
        if decode not in DECODERS and not isinstance(decode, StaticDecoder):
            raise SettingError(f"decode={decode!r} must be one of {', '.join(DECODERS)} or a StaticDecoder")
        key_mask = None  # [B, T0] bool where prompts are padded
        if prompt_mask is not None and not bool(prompt_mask.all()):
            key_mask = self.check_prompt_mask(prompt_mask, idx.shape)
        if decode == "auto":
            decode = auto_decoder(idx.device.type, max_new_tokens)
        if decode in ("static", "compiled"):
            decode = self.static_decoder(B, compile=decode == "compiled")
        if isinstance(decode, StaticDecoder):
            logits, step_at = decode.prefill(idx, key_mask), decode.step  # [B, vocab]
        else:
            caches = self.build_kv_caches(B, total)
            if key_mask is not None:
                padding = torch.ones(B, total, dtype=torch.bool, device=idx.device)  # [B, total]
                padding[:, :T0] = key_mask
                for cache in caches:
                    cache.key_mask = padding
            logits = self.prefill(idx, caches)  # [B, vocab]

            def step_at(tokens: torch.Tensor, position: int) -> torch.Tensor:
                return self(tokens, position, caches)[:, -1]  # [B, vocab]

        every = stop_check_interval(idx.device.type)
        out, done, finished = [idx], torch.zeros(B, dtype=torch.bool, device=idx.device), []
        stops = torch.tensor(stop_tokens, dtype=idx.dtype, device=idx.device)
        for step in range(max_new_tokens):
            nxt = sample(logits, temperature, top_k, top_p, generator)  # [B]
            if stop_tokens:
                nxt = torch.where(done, out[-1][:, -1], nxt)
                done |= torch.isin(nxt, stops)
                finished.append(done.all())  # []
            out.append(nxt[:, None])
            if step + 1 == max_new_tokens or (stop_tokens and (step + 1) % every == 0 and bool(finished[-1])):
                break
            logits = step_at(nxt[:, None], T0 + step)  # [B, vocab]
        tokens = torch.cat(out, dim=1)  # [B, T0 + n]
        if stop_tokens and every > 1:  # end where a read at every step would have: at the first all-stopped step
            stopped = torch.stack(finished)  # [n]
            if bool(stopped.any()):
                tokens = tokens[:, : T0 + int(stopped.int().argmax()) + 1]
        return tokens

    def check_prompt_mask(self, prompt_mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """Validate a left-padding mask [B, T0] (False then True in each row) -> bool [B, T0]."""
        mask = prompt_mask.to(torch.bool)
        if mask.shape != shape:
            raise ValueError(f"prompt_mask has shape {tuple(mask.shape)} but the prompts have shape {tuple(shape)}")
        if not bool(mask[:, -1].all()) or bool((mask[:, 1:].int() < mask[:, :-1].int()).any()):
            raise ValueError(
                "prompt_mask must mark left padding: in each row, False (padding) before True (tokens), "
                "ending with a real token; build it with t6.model.t6.left_pad"
            )
        unsupported = sorted({type(b.attn).__name__ for b in self.blocks if not b.attn.supports_key_mask})
        if unsupported:
            raise SettingError(
                f"attention={self.cfg.attention!r} ({', '.join(unsupported)}) does not honour padding masks; "
                "generate prompts of different lengths one at a time or in equal-length batches"
            )
        return mask


DECODERS = ("auto", "eager", "static", "compiled")  # T6.generate's decode=


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists of different lengths -> idx [B, T0] left-padded with pad_id, prompt_mask [B, T0] bool."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    T0 = max(len(p) for p in prompts)
    idx = torch.full((len(prompts), T0), pad_id, dtype=torch.long)  # [B, T0]
    mask = torch.zeros(len(prompts), T0, dtype=torch.bool)  # [B, T0]
    for i, p in enumerate(prompts):
        idx[i, T0 - len(p) :] = torch.as_tensor(p, dtype=torch.long)
        mask[i, T0 - len(p) :] = True
    return idx, mask


def stop_check_interval(device_type: str) -> int:
    """Every how many tokens `generate` reads back whether every row has stopped: each read makes the host
    wait for the device, which on a GPU then idles while the host launches the next step; free on the CPU."""
    return 1 if device_type == "cpu" else 8


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    problems = []
    if temperature < 0:
        problems.append(f"temperature={temperature} must be >= 0 (0 is greedy)")
    if top_k is not None and (not isinstance(top_k, int) or top_k <= 0):
        problems.append(f"top_k={top_k!r} must be a positive integer or null")
    if top_p is not None and not 0 < top_p <= 1:
        problems.append(f"top_p={top_p!r} must be in (0, 1] or null")
    if problems:
        raise SettingError("Invalid sampling settings:\n  - " + "\n  - ".join(problems))


def sample(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [B, vocab] -> next token ids [B]: greedy at temperature 0, else top-k / nucleus sampling."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True)  # [B, vocab]
        probs = sorted_logits.softmax(-1).cumsum(-1)  # [B, vocab]
        drop = probs - sorted_logits.softmax(-1) > top_p  # keep the smallest prefix with mass >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
