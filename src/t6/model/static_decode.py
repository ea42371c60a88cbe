"""Fixed-shape decoding: a decode step that compiles once and replays as a CUDA graph.

One token at a time, a GPU waits on the host: Python, the dispatcher and a kernel launch per
operation cost ~1 ms per layer and token on an H100, against ~0.1 ms of GPU work. A CUDA graph
removes that cost, but only for a step whose shapes and memory never change. `StaticDecoder`
makes such a step:

- the caches are allocated once at full length (`max_len`) and kept for later generations;
- each step writes its token in place at a position held in a device tensor and attends over a
  fixed-length view of the caches (`KVCache.static_len`): a power-of-two bucket of the context
  (`bucket`), the positions after the newest masked;
- nothing is read back to the host.

So `T6.decode_step` compiles with `fullgraph=True` once per (batch, bucket) and, on CUDA, is captured
as a CUDA graph by torch.compile(mode="reduce-overhead") and replayed for every token of the bucket.
The prompt is prefilled eagerly, as `T6.forward` does.

    decoder = StaticDecoder(model, batch_size=4)
    logits = decoder.prefill(idx, key_mask)        # [B, vocab] at the last prompt position
    logits = decoder.step(tokens, position)        # tokens [B, 1] at the Python int `position`
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from t6.model.t6 import T6

MIN_BUCKET = 256  # the shortest cache view a step runs at: shorter contexts share its graph


def bucket(length: int, max_len: int, least: int = MIN_BUCKET) -> int:
    """The cache length a step with `length` cached tokens (the new one included) runs at: the next
    power of two, at least `least`, at most max_len."""
    if not 0 < length <= max_len:
        raise ValueError(f"a decode step over {length} cached tokens does not fit a cache of {max_len} positions")
    return min(max_len, max(least, 1 << (length - 1).bit_length()))


def compile_step(fn, device: torch.device | str, backend="inductor"):
    """fn compiled whole (fullgraph=True) for fixed shapes (dynamic=False: one graph per shape, never a
    symbolic one); with inductor on CUDA, captured as a CUDA graph (mode="reduce-overhead"). On the CPU,
    inductor compiles the step too, but torch 2.13's C++ FlexAttention decoding kernel fails on grouped
    query heads (GQA, MQA, GTA) from ~512 cached tokens on; generation keeps the eager step there."""
    mode = "reduce-overhead" if backend == "inductor" and torch.device(device).type == "cuda" else None
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend, mode=mode)


# One graph per mechanism, batch and bucket is this design, not a recompilation: dynamo compiles one function at most
# 8 times (config.recompile_limit), then refuses, and with fullgraph fails. Lifted while a decoder steps only.
DYNAMO_LIMITS = {"recompile_limit": 1 << 16, "accumulated_recompile_limit": 1 << 16}


def call_step(step, *args):
    """step(*args) with dynamo's recompile limits lifted for the call (DYNAMO_LIMITS), restored after it."""
    with torch._dynamo.config.patch(**DYNAMO_LIMITS):
        return step(*args)


class StaticDecoder:
    """Fixed-shape greedy or sampled decoding for one batch size: the caches (max_len positions, default
    the model's block_size, in `dtype`), a key mask, and the compiled step. The step's inputs (tokens,
    position, caches, mask) live at fixed addresses, so a CUDA graph reads and writes them in place.
    backend: torch.compile's, a name or a callable ("inductor"; tests use "eager" or "aot_eager", which
    check the same graph without generating code)."""

    def __init__(
        self,
        model: T6,
        batch_size: int,
        max_len: int | None = None,
        dtype: torch.dtype | None = None,
        backend="inductor",
    ):
        self.model, self.batch_size = model, batch_size
        self.max_len = max_len or model.cfg.block_size
        if self.max_len > model.cfg.block_size:
            raise ValueError(f"max_len={self.max_len} exceeds the model's block_size {model.cfg.block_size}")
        device = model.embed.weight.device
        self.caches = model.build_kv_caches(batch_size, self.max_len, dtype, device)
        self.key_mask = torch.ones(batch_size, self.max_len, dtype=torch.bool, device=device)  # [B, max_len]
        self.tokens = torch.zeros(batch_size, 1, dtype=torch.long, device=device)  # [B, 1]
        self.pos = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        for t in (self.key_mask, self.tokens, self.pos, *(t for c in self.caches for t in c.tensors.values())):
            torch._dynamo.mark_static_address(t)  # a CUDA graph reads and writes it where it is
        self.step_fn = compile_step(model.decode_step, device, backend)

    @torch.no_grad()
    def prefill(self, idx: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Write the prompts idx [B, T0] at positions 0..T0-1 -> logits [B, vocab] at the last one, eagerly.
        key_mask: None, or bool [B, T0] marking the real tokens of left-padded prompts (T6.check_prompt_mask)."""
        B, T0 = idx.shape
        if B != self.batch_size:
            raise ValueError(f"{B} prompts, but this decoder was built for batch_size={self.batch_size}")
        self.key_mask.fill_(True)
        if key_mask is not None:
            self.key_mask[:, :T0] = key_mask
        for cache in self.caches:
            cache.static_len = None
            cache.key_mask = None if key_mask is None else self.key_mask  # unpadded: SDPA's causal kernel
        logits = self.model(idx, 0, self.caches)[:, -1]  # [B, vocab]
        for cache in self.caches:
            cache.key_mask = self.key_mask  # every step masks (the positions after the newest)
        return logits

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """tokens [B, 1] at `position` (a Python int: the host knows it, nothing is read back) -> logits
        [B, vocab]. On CUDA the logits live in the graph's memory until the next step: sample first."""
        length = bucket(position + 1, self.max_len)
        if self.caches[0].static_len != length:
            for cache in self.caches:
                cache.static_len = length
        self.tokens.copy_(tokens)
        self.pos.fill_(position)
        if self.pos.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's logits are consumed
        return call_step(self.step_fn, self.tokens, self.pos, self.caches)
