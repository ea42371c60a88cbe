"""Model facts, read off the built model: parameters, KV cache per token, FLOPs per token.

Every script that reports what a configuration costs (summary, report, benchmarks, training's
MLflow parameters, uptraining) calls these, so each fact has one definition. The model is built
on the meta device: shapes only, no memory, no compute.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch.overrides import TorchFunctionMode

from t6.model.config import ModelConfig
from t6.model.t6 import T6


class _SkipInit(TorchFunctionMode):
    """torch.nn.init's functions return their tensor untouched: on the meta device they compute nothing, yet running
    them through the meta kernels was ~80% of building a model there (0.28 s a model: the matching solver and every
    plan build many)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


def meta_model(cfg: ModelConfig) -> T6:
    """The model with every tensor on the meta device (shapes, no values: its initializers are skipped)."""
    with torch.device("meta"), _SkipInit():
        return T6(cfg)


def parameter_count(cfg: ModelConfig | T6, non_embedding: bool = False) -> int:
    """Distinct parameters (the tied head counts once); non_embedding leaves out the token embedding."""
    model = cfg if isinstance(cfg, T6) else meta_model(cfg)
    return model.num_params(non_embedding=non_embedding)


def attention_layer(cfg: ModelConfig):
    """One attention layer of the model, built on the meta device (every block's is the same)."""
    from t6.model.attention import get_attention_class

    with torch.device("meta"):
        return get_attention_class(cfg.attention)(cfg)


def kv_cache_spec(cfg: ModelConfig | T6) -> dict[str, tuple[int, ...]]:
    """Per-token shape of each tensor one layer caches (the attention's `cache_spec`)."""
    attn = cfg.blocks[0].attn if isinstance(cfg, T6) else attention_layer(cfg)
    return dict(attn.cache_spec())


def kv_elements_per_token(cfg: ModelConfig | T6) -> int:
    """Numbers one layer caches per token (paper Table 1's 'KV cache per token'), from cache_spec."""
    return sum(math.prod(shape) for shape in kv_cache_spec(cfg).values())


def kv_bytes_per_token(cfg: ModelConfig | T6, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes the whole model caches per token (every layer) at a cache dtype."""
    model_cfg = cfg.cfg if isinstance(cfg, T6) else cfg
    return kv_elements_per_token(cfg) * dtype.itemsize * model_cfg.n_layer


def flops_per_token(cfg: ModelConfig | T6, seq_len: int | None = None, training: bool = True) -> float:
    """FLOPs per token of one training step (forward + backward of next-token cross-entropy) or of one
    forward pass, over a sequence of seq_len tokens (default: block_size), as counted by
    torch.utils.flop_counter.FlopCounterMode (matmuls, and attention's QK^T and AV in full, causal mask or
    not; elementwise ops are not counted, as in the usual 6N + attention estimate). MFU = this x tokens/s /
    peak FLOP/s. On a model with real tensors, its gradients are left untouched."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = cfg if isinstance(cfg, T6) else meta_model(cfg)
    seq_len = seq_len or model.cfg.block_size
    device = next(model.parameters()).device
    idx = torch.randint(0, model.cfg.vocab_size, (1, seq_len + 1), device=device)
    saved = [p.grad for p in model.parameters()]
    counter = FlopCounterMode(display=False)
    # the math SDPA backend is made of matmuls the counter sees on every device (CPU's fused kernel is not
    # counted); no torch.no_grad for the forward count: the counter's module hooks reject no-grad views
    try:
        with counter, sdpa_kernel(SDPBackend.MATH):
            logits = model(idx[:, :-1])  # [1, T, V]
            if training:
                F.cross_entropy(logits.flatten(0, 1).float(), idx[:, 1:].flatten()).backward()
    finally:
        for p, g in zip(model.parameters(), saved):
            p.grad = g
    return counter.get_total_flops() / seq_len


def attention_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """FLOPs per token of one attention layer in a training step (forward and backward, the gradient of its
    input included, as inside the model) over seq_len tokens (default: block_size), counted as
    `flops_per_token` counts them, on the layer built on the meta device. Every block holds the same layer, so
    a model's flops_per_token changes by n_layer x this when only its attention changes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    seq_len = seq_len or cfg.block_size
    attn = attention_layer(cfg)
    x = torch.zeros(1, seq_len, cfg.d_model, device="meta", requires_grad=True)  # [1, T, d_model]
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        attn(x, torch.arange(seq_len, device="meta")).sum().backward()  # [1, T, d_model] -> []
    return counter.get_total_flops() / seq_len


def decode_flops_per_cached_token(cfg: ModelConfig | T6) -> float:
    """FLOPs one new token spends per cached token in one layer and batch row (the part of a decode
    step that grows with the context), counted by torch.utils.flop_counter as the difference of two
    cached decode steps (64 and 128 cached tokens) through the mechanism's own decode path, on one
    attention layer built on the CPU (matmuls and attention; elementwise work is not counted)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from t6.model.attention import get_attention_class

    model_cfg = replace(cfg.cfg if isinstance(cfg, T6) else cfg, n_layer=1, block_size=129)
    attn = get_attention_class(model_cfg.attention)(model_cfg)
    counts = []
    for context in (64, 128):
        cache = attn.build_kv_cache(1, context + 1)
        counter = FlopCounterMode(display=False)
        with counter, sdpa_kernel(SDPBackend.MATH):  # (no no_grad: the counter's module hooks reject it)
            attn(torch.zeros(1, 1, model_cfg.d_model), torch.tensor([context]), cache)  # one new token
        counts.append(counter.get_total_flops())
    return (counts[1] - counts[0]) / 64


def model_facts(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """The facts training logs and reports read back: parameters and KV cache per token."""
    model = meta_model(cfg)
    return {
        "params": parameter_count(model),
        "params_non_embedding": parameter_count(model, non_embedding=True),
        "kv_cache_elements_per_token_per_layer": kv_elements_per_token(model),
        "kv_cache_bytes_per_token": kv_bytes_per_token(model, dtype),
    }
