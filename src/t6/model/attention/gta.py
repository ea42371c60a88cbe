"""Grouped-Tied Attention (GTA; Zadouri, Strauss & Dao, "Hardware-Efficient Attention for Fast
Decoding", arXiv 2505.21487).

Keys and values are tied into ONE state per KV group; a second, single-head projection carries
the positional (RoPE) half of the key, shared by every head (as MLA's decoupled RoPE key):

    kv     = W_KV x                               [G, d_h]   the tied state, no RoPE
    k_rope = R_t W_KR x                           [d_h/2]    one RoPE key shared by all heads
    q_i    = [q_nope_i | R_t q_rope_i] = W_Q x    [d_h]      per query head, last half rotated
    key of group g:   k_g = [kv_g[:d_h/2] | k_rope]          [d_h]   (first half of the tie, no RoPE)
    value of group g: v_g = kv_g                             [d_h]   (the whole tied state)
    head i in group g = i // (h / G):  softmax(q_i . k_g / sqrt(d_h)) v_g

Cached per token and layer: the tied state and the rotated shared RoPE key,
G d_h + d_h/2 numbers (GQA with the same G caches 2 G d_h: GTA about halves it).

Parameters per layer: W_Q and W_O (2 h d_h d_model), W_KV (G d_h d_model), W_KR (d_h/2 d_model).

Initialization: N(0, init_std) on every projection, zero W_O (`Attention.init_weights`).
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
class GTAOptions(Options):
    n_kv_head: int = 2  # G, tied KV states; must divide size.n_head

    def problems(self, cfg: ModelConfig) -> list[str]:
        problems = super().problems(cfg)
        if not problems and cfg.n_head % self.n_kv_head:
            problems.append(
                f"size.n_head={cfg.n_head} must be divisible by attention.options.n_kv_head={self.n_kv_head}"
            )
        if isinstance(cfg.head_dim, int) and cfg.head_dim % 4:
            problems.append(
                f"size.head_dim={cfg.head_dim} must be divisible by 4 for attention=gta "
                "(RoPE rotates pairs in the key's second half, d_h/2 wide)"
            )
        return problems


@register("gta")
class GroupedTiedAttention(Attention):
    Options = GTAOptions
    supports_key_mask = True
    # The tied state cached [B, G, max_len, d_h]: each group's keys/values one contiguous block
    # (as GQA's K and V). The shared RoPE key is one head, so token-major is already contiguous.
    head_major_cache = ("kv",)
    # Single-token cached steps run t6::gqa_decode when True (as GroupedQueryAttention.fused_decode): keys the
    # first half of each group's tied state plus the shared RoPE key, values the whole state, each group's
    # state read once for its query heads; False keeps them on SDPA over the assembled keys.
    fused_decode: bool = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        h, d = cfg.n_head, cfg.head_dim
        self.n_kv = self.opts.n_kv_head  # G
        self.d_rope = d // 2  # RoPE half of queries and keys
        self.q = nn.Linear(cfg.d_model, h * d, bias=False)  # W_Q
        self.kv = nn.Linear(cfg.d_model, self.n_kv * d, bias=False)  # W_KV, the tied state
        self.k_rope = nn.Linear(cfg.d_model, self.d_rope, bias=False)  # W_KR, one head
        self.out = nn.Linear(h * d, cfg.d_model, bias=False)
        self.rope = Rotary(self.d_rope, cfg.block_size, cfg.rope_theta, cfg.rope_remap)

    def cache_spec(self) -> dict[str, tuple[int, ...]]:
        return {"kv": (self.n_kv, self.cfg.head_dim), "k_rope": (self.d_rope,)}

    def tied_keys(self, kv: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
        """Each group's key from its tied state kv [B, G, S, d] and the shared RoPE key k_rope [B, S, d/2] ->
        [B, G, S, d]: [first half of the tie | RoPE key]."""
        B, G, S, d = kv.shape
        k_shared = k_rope[:, None].expand(B, G, S, self.d_rope)  # [B, G, S, d/2], broadcast to every group
        return torch.cat([kv[..., : d - self.d_rope], k_shared], dim=-1)  # [B, G, S, d]

    def cached_keys_values(self, cache: KVCache, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        views = cache.views(end)
        return self.tied_keys(views["kv"], views["k_rope"]), views["kv"]  # [B, G, end, d] each; values: the tie

    def stackable(self) -> dict[str, tuple[nn.Module, ...]]:
        return stackable(qkv=(self.q, self.kv, self.k_rope))

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        h, d, r = self.cfg.n_head, self.cfg.head_dim, self.d_rope
        stacked = None if cache is None else cache.stacked.get("qkv")
        q, kv, k_rope = (self.q(x), self.kv(x), self.k_rope(x)) if stacked is None else stacked(x)  # one matmul
        q_nope, q_rope = q.view(B, T, h, d).split([d - r, r], dim=-1)  # [B, T, h, d/2] each
        q_rope = self.rope(q_rope, pos)  # [B, T, h, d/2]
        kv = kv.view(B, T, self.n_kv, d)  # [B, T, G, d]
        k_rope = self.rope(k_rope[:, :, None], pos)[:, :, 0]  # [B, T, d/2], shared by all heads
        if cache is not None:
            kv, k_rope = cache.update(pos, kv=kv, k_rope=k_rope)  # [B, G, S, d] (head-major), [B, S, d/2]
            if T == 1 and self.fused_decode and self.recorded is None:
                scale = d**-0.5  # SDPA's, over the whole key [nope | rope]
                y = gqa_decode(
                    q_nope[:, 0] * scale,  # [B, h, d/2]
                    kv[..., : d - r],  # keys: the first half of each tied state [B, G, S, d/2]
                    kv,  # values: the whole state [B, G, S, d]
                    q_rope[:, 0] * scale,  # [B, h, d/2]
                    k_rope,  # the shared RoPE key [B, S, d/2]
                    cache.decode_key_mask(pos),
                    cache.lengths(pos),
                )  # [B, h, d]
                return self.project(y.reshape(B, T, h * d), x)  # [B, 1, d_model]
        else:
            kv = kv.transpose(1, 2)  # [B, G, T, d]
        q = torch.cat([q_nope, q_rope], dim=-1)  # [B, T, h, d]: [nope | rotated]
        y = self.attend(q.transpose(1, 2), self.tied_keys(kv, k_rope), kv, pos, cache)  # [B, h, T, d], values: kv
        return self.project(y.transpose(1, 2).reshape(B, T, h * d), x)  # [B, T, d_model]
