"""Multi-head, multi-query and grouped-query attention (one class, `n_kv_head` sets the family).

- gqa: n_kv_head = G groups of query heads, each sharing a K/V head (Ainslie et al. 2023)
- mha: the preset n_kv_head = None, one K/V head per query head (Vaswani et al. 2017)
- mqa: the preset n_kv_head = 1, one K/V head shared by all query heads (Shazeer 2019)

Cached per token and layer: K and V for the KV heads only, 2 * n_kv_head * d_h numbers
(MHA 2 h d_h, MQA 2 d_h, GQA 2 G d_h; paper Table 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from t6.model.attention.base import Attention, KVCache, Options, register, stackable
from t6.model.attention.fused_decode import gqa_decode
from t6.model.layers import Rotary

if TYPE_CHECKING:  # the model config imports the registry; type hints only
    from t6.model.config import ModelConfig


@dataclass
class GQAOptions(Options):
    n_kv_head: int | None = 2  # G, K/V heads; must divide size.n_head. None: one per query head (MHA)

    def problems(self, cfg: ModelConfig) -> list[str]:
        problems = super().problems(cfg)
        if not problems and self.n_kv_head is not None and cfg.n_head % self.n_kv_head:
            problems.append(
                f"size.n_head={cfg.n_head} must be divisible by attention.options.n_kv_head={self.n_kv_head}"
            )
        return problems


@register("gqa")
@register("mha", n_kv_head=None)
@register("mqa", n_kv_head=1)
class GroupedQueryAttention(Attention):
    Options = GQAOptions
    supports_key_mask = True
    # K and V cached [B, h_kv, max_len, d_h]: SDPA reads each head's keys as one contiguous
    # block (a token-major cache read through a strided view decodes ~2x slower on CPU).
    head_major_cache = ("k", "v")
    # Single-token cached steps run the fused operator t6::gqa_decode (each K/V head read once for its group,
    # the keys split across threads or GPU programs, a fixed-shape step's reads bounded by the device's
    # lengths; C++ on the CPU, Triton on CUDA) when True; False keeps them on SDPA (`attend`, the reference).
    fused_decode: bool = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        h, d = cfg.n_head, cfg.head_dim
        self.n_kv = self.opts.n_kv_head or h  # K/V heads
        self.q = nn.Linear(cfg.d_model, h * d, bias=False)
        self.k = nn.Linear(cfg.d_model, self.n_kv * d, bias=False)
        self.v = nn.Linear(cfg.d_model, self.n_kv * d, bias=False)
        self.out = nn.Linear(h * d, cfg.d_model, bias=False)
        self.rope = Rotary(d, cfg.block_size, cfg.rope_theta, cfg.rope_remap)

    def cache_spec(self) -> dict[str, tuple[int, ...]]:
        return {"k": (self.n_kv, self.cfg.head_dim), "v": (self.n_kv, self.cfg.head_dim)}

    def cached_keys_values(self, cache: KVCache, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        views = cache.views(end)
        return views["k"], views["v"]  # [B, h_kv, end, d] each: the cache itself (head-major)

    def stackable(self) -> dict[str, tuple[nn.Module, ...]]:
        return stackable(qkv=(self.q, self.k, self.v))

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        h, d = self.cfg.n_head, self.cfg.head_dim
        stacked = None if cache is None else cache.stacked.get("qkv")
        if stacked is not None:  # one matmul; Q and K adjacent in its output, rotated in one pass
            qkv = stacked.matmul(x)  # [B, T, (h + 2 h_kv) d]
            qk = self.rope(
                qkv[..., : (h + self.n_kv) * d].unflatten(-1, (h + self.n_kv, d)), pos
            )  # [B, T, h + h_kv, d]
            q, k = qk.split([h, self.n_kv], dim=2)  # [B, T, h, d], [B, T, h_kv, d]
            v = qkv[..., (h + self.n_kv) * d :].unflatten(-1, (self.n_kv, d))  # [B, T, h_kv, d]
        else:
            q = self.rope(self.q(x).view(B, T, h, d), pos)  # [B, T, h, d]
            k = self.rope(self.k(x).view(B, T, self.n_kv, d), pos)  # [B, T, h_kv, d]
            v = self.v(x).view(B, T, self.n_kv, d)  # [B, T, h_kv, d]
        if cache is not None:
            k, v = cache.update(pos, k=k, v=v)  # [B, h_kv, S, d] each (head-major), S = pos[-1] + 1
            if T == 1 and self.fused_decode and self.recorded is None:
                y = gqa_decode(q[:, 0] * d**-0.5, k, v, None, None, cache.decode_key_mask(pos), cache.lengths(pos))
                return self.project(y.reshape(B, T, h * d), x)  # [B, h, d] -> [B, 1, d_model]
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, h_kv, T, d] each
        y = self.attend(q.transpose(1, 2), k, v, pos, cache)  # [B, h, T, d]
        return self.project(y.transpose(1, 2).reshape(B, T, h * d), x)  # [B, T, d_model]
