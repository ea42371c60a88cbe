"""Grouped Latent Attention (GLA, Zadouri, Strauss & Dao 2025, arXiv 2505.21487).

MLA (mla.py) whose KV latent is split into n latent heads, each of width d_c, and whose h query
heads are split into n contiguous groups of g = h / n: group j's keys and values are expanded
from latent head j only (GLA-2: n = 2). Queries and the decoupled RoPE key are MLA's:

    c_q  = RMSNorm(W_DQ x)                            [d_cq]
    q    = W_UQ c_q  -> per head [q_nope (d_nope) | q_rope (d_rope)]
    c_1 .. c_n, k_rope = split(W_DKV x)               n x [d_c], [d_rope]  (k_rope shared by all heads)
    c_j  = RMSNorm_j(c_j)                             one norm per latent head
    head i in group j = i // g:
        k_nope_i, v_i = split(W_UKV^(i) c_j)          [d_nope], [d_v]   (W_UKV^(i): [d_nope + d_v, d_c])
        softmax([q_nope_i | R_t q_rope_i] . [k_nope_i | R_s k_rope] / sqrt(d_nope + d_rope)) v_i

Cached per token and layer: the n normalized latent heads and the rotated shared key,
n d_c + d_rope numbers. The paper's GLA-2 takes d_c = 2 d_h per latent head against MLA's
4 d_h, so both cache the same amount; a device holding one group's heads reads only its latent
head (d_c + d_rope), which is what makes GLA shard under tensor parallelism where MLA duplicates
its one latent on every device. With n = 1 GLA is exactly MLA: the same weights (MLA's kv_norm is
kv_norm.0 here) give the same outputs, cached and uncached.

Decoding with a cache uses MLA's absorbed form per latent head: head i folds its W_UK^(i) into
its query (a d_c-wide query that scores c_j directly), attention averages c_j, and W_UV^(i)
expands the result, so per-head keys and values are never materialized. Training (no cache)
uses the explicit up-projections, and so does a prefill into an empty cache (SDPA's flash kernel, no
[B, h, T, S] scores). Both are the same function (tests/test_model.py checks it).

Initialization: N(0, init_std) on every projection, ones on the norms, zero W_O (`Attention.init_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from t6.model.attention.base import Attention, KVCache, linear_weight, plain_linear, register, stackable
from t6.model.attention.fused_decode import gqa_decode
from t6.model.attention.mla import MLAOptions, explicit_attention, latent_keys
from t6.model.layers import Rotary

if TYPE_CHECKING:  # the model config imports the registry; type hints only
    from t6.model.config import ModelConfig


@dataclass
class GLAOptions(MLAOptions):
    kv_lora_rank: int = 128  # d_c, the width of each cached latent head
    n_latent_heads: int = 2  # n, latent heads; must divide size.n_head (1: MLA)

    def problems(self, cfg: ModelConfig) -> list[str]:
        problems = super().problems(cfg)
        if not problems and cfg.n_head % self.n_latent_heads:
            problems.append(
                f"size.n_head={cfg.n_head} must be divisible by attention.options.n_latent_heads={self.n_latent_heads}"
            )
        return problems


@register("gla")
class GroupedLatentAttention(Attention):
    Options = GLAOptions
    supports_key_mask = True
    # Latent heads cached [B, n, max_len, d_c]: each latent head's tokens contiguous, so a group
    # reads its own latent as one block (and the fused operator takes it as a strided view).
    head_major_cache = ("c_kv",)
    # True runs single-token cached steps through t6::gqa_decode, each latent head the keys and values of its
    # group's query heads (read once), the RoPE key shared; False the eager absorbed form.
    fused_decode: bool = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        o, h = self.opts, cfg.n_head
        self.n_lat, self.d_cq, self.d_c, self.d_rope = o.n_latent_heads, o.q_lora_rank, o.kv_lora_rank, o.rope_dim
        self.group = h // self.n_lat  # g, query heads per latent head
        self.d_nope = o.nope_dim or cfg.head_dim  # per-head no-RoPE query/key width
        self.d_v = o.v_dim or cfg.head_dim
        self.q_down = nn.Linear(cfg.d_model, self.d_cq, bias=False)  # W_DQ
        self.q_norm = nn.RMSNorm(self.d_cq, eps=cfg.norm_eps)
        self.q_up = nn.Linear(self.d_cq, h * (self.d_nope + self.d_rope), bias=False)  # W_UQ and W_QR
        self.kv_down = nn.Linear(cfg.d_model, self.n_lat * self.d_c + self.d_rope, bias=False)  # W_DKV and W_KR
        self.kv_norm = nn.ModuleList(nn.RMSNorm(self.d_c, eps=cfg.norm_eps) for _ in range(self.n_lat))
        # W_UK and W_UV of every head, each reading d_c numbers: rows of head i apply to latent head i // g.
        self.kv_up = nn.Linear(self.d_c, h * (self.d_nope + self.d_v), bias=False)
        self.out = nn.Linear(h * self.d_v, cfg.d_model, bias=False)
        self.rope = Rotary(self.d_rope, cfg.block_size, cfg.rope_theta, cfg.rope_remap)
        self.scale = (self.d_nope + self.d_rope) ** -0.5

    def stackable(self) -> dict[str, tuple[nn.Module, ...]]:
        return stackable(down=(self.q_down, self.kv_down))

    def cache_spec(self) -> dict[str, tuple[int, ...]]:
        return {"c_kv": (self.n_lat, self.d_c), "k_rope": (self.d_rope,)}

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.cfg.n_head
        stacked = None if cache is None else cache.stacked.get("down")
        q_lat, kv = (self.q_down(x), self.kv_down(x)) if stacked is None else stacked(x)  # both down maps: one matmul
        q = self.q_up(self.q_norm(q_lat)).view(B, T, h, self.d_nope + self.d_rope)  # [B, T, h, nope+rope]
        q_nope, q_rope = q.split([self.d_nope, self.d_rope], dim=-1)  # [B, T, h, nope], [B, T, h, rope]
        q_rope = self.rope(q_rope, pos)  # [B, T, h, rope]
        c_kv, k_rope = kv.split([self.n_lat * self.d_c, self.d_rope], dim=-1)  # [B,T,n*d_c], [B,T,rope]
        c_kv = c_kv.view(B, T, self.n_lat, self.d_c)  # [B, T, n, d_c]
        c_kv = torch.stack([norm(c) for norm, c in zip(self.kv_norm, c_kv.unbind(2))], dim=2)  # [B, T, n, d_c]
        k_rope = self.rope(k_rope[:, :, None], pos)[:, :, 0]  # [B, T, rope], one key shared by all heads
        if cache is None:
            y = self._explicit(q_nope, q_rope, c_kv, k_rope)  # [B, T, h, d_v]
        elif T > 1 and cache.from_start(pos):  # a prefill: explicit and causal, SDPA's flash kernel, no [T, S] scores
            cache.update(pos, c_kv=c_kv, k_rope=k_rope)
            y = self._explicit(q_nope, q_rope, c_kv, k_rope)  # [B, T, h, d_v]
        else:
            c_kv, k_rope = cache.update(pos, c_kv=c_kv, k_rope=k_rope)  # [B, n, S, d_c], [B, S, rope]
            y = self._absorbed(q_nope, q_rope, c_kv, k_rope, cache, pos)  # [B, T, h, d_v]
        return self.project(y.reshape(B, T, h * self.d_v), x)  # [B, T, d_model]

    def _explicit(self, q_nope, q_rope, c_kv, k_rope) -> torch.Tensor:
        """Training path: expand each latent head into its group's keys and values, then SDPA.
        c_kv: [B, S, n, d_c]."""
        k_nope, v = self.expand_latents(c_kv)  # [B, S, h, nope], [B, S, h, d_v]
        return explicit_attention(self, q_nope, q_rope, k_nope, v, k_rope, self.scale)  # [B, T, h, d_v]

    def cached_keys_values(self, cache: KVCache, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        views = cache.views(end)
        k_nope, v = self.expand_latents(views["c_kv"].transpose(1, 2))  # [B, end, h, nope], [B, end, h, d_v]
        k = latent_keys(k_nope, views["k_rope"])  # [B, end, h, nope+rope]
        return k.transpose(1, 2), v.transpose(1, 2)  # [B, h, end, nope+rope], [B, h, end, d_v]

    def expand_latents(self, c_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each latent head c_kv [B, S, n, d_c] through its group's W_UK and W_UV -> per-head k_nope [B, S, h, nope],
        v [B, S, h, d_v]."""
        B, S = c_kv.shape[:2]
        h = self.cfg.n_head
        n, g, m = self.n_lat, self.group, self.d_nope + self.d_v
        if plain_linear(self.kv_up):
            w = self.kv_up.weight.view(n, g * m, self.d_c)  # [n, g*(nope+d_v), d_c]
            kv = torch.einsum("bsjc,jmc->bsjm", c_kv, w)  # [B, S, n, g*(nope+d_v)]
        else:  # a wrapped projection (a LoRA adapter) called as a module: each latent head through every group's
            # rows, then each group's rows of its own latent head kept
            kv = self.kv_up(c_kv).view(B, S, n, n, g * m)  # [B, S, latent head, group, g*(nope+d_v)]
            kv = kv.diagonal(dim1=2, dim2=3).transpose(2, 3)  # [B, S, n, g*(nope+d_v)]
        kv = kv.reshape(B, S, h, m)  # [B, S, h, nope+d_v]
        k_nope, v = kv.split([self.d_nope, self.d_v], dim=-1)  # [B, S, h, nope], [B, S, h, d_v]
        return k_nope, v

    def _absorbed(self, q_nope, q_rope, c_kv, k_rope, cache: KVCache, pos: torch.Tensor) -> torch.Tensor:
        """Decoding path: each group attends over its cached latent head with W_UK and W_UV absorbed.
        c_kv: [B, n, S, d_c]. The cache gives what the queries at pos may see: one new token's key mask and lengths
        for the fused operator (KVCache.decode_key_mask, KVCache.lengths), else the mask of `attn_mask`."""
        B, T, h = q_nope.shape[:3]
        n, g, S = self.n_lat, self.group, c_kv.shape[2]
        w = linear_weight(self.kv_up, self.d_c).view(h, self.d_nope + self.d_v, self.d_c)  # [h, nope+d_v, d_c]
        w_uk, w_uv = w.split([self.d_nope, self.d_v], dim=1)  # [h, nope, d_c], [h, d_v, d_c]
        q_lat = torch.einsum("bthn,hnc->bhtc", q_nope, w_uk)  # [B, h, T, d_c]: q_nope^T W_UK, per head
        if T == 1 and self.fused_decode and S > 1 and self.recorded is None:
            o = gqa_decode(
                (q_lat * self.scale).reshape(B, h, self.d_c),  # group j's heads adjacent: [B, h, d_c]
                c_kv,  # keys: latent head j for group j [B, n, S, d_c]
                c_kv,  # values: the same rows, read once
                (q_rope * self.scale).reshape(B, h, self.d_rope),  # [B, h, rope]
                k_rope,  # the shared RoPE key [B, S, rope]
                cache.decode_key_mask(pos),
                cache.lengths(pos),
            )  # [B, h, d_c]: group j against latent head j
            return torch.einsum("bhc,hvc->bhv", o, w_uv)[:, None]  # [B, 1, h, d_v]: W_UV applied after attention
        mask = cache.attn_mask(pos)  # [B or 1, T, S] or None
        # The g heads of a group share one key/value (their latent head), so they become extra query
        # rows of one batched matmul per latent head: the cache is read once, never copied per head.
        scores = q_lat.reshape(B, n, g * T, self.d_c) @ c_kv.transpose(2, 3)  # [B, n, g*T, S]: latent part
        rope = q_rope.transpose(1, 2).reshape(B, h * T, self.d_rope) @ k_rope.transpose(1, 2)  # [B, h*T, S]
        scores = (scores.view(B, h, T, S) + rope.view(B, h, T, S)) * self.scale  # [B, h, T, S]
        if mask is not None:  # causal among the new tokens, blind to padding
            scores = scores.masked_fill(~mask[:, None], float("-inf"))  # [B, h, T, S]
        probs = scores.float().softmax(dim=-1)  # [B, h, T, S]
        if self.recorded is not None:
            self.recorded.append(probs)
        probs = probs.to(c_kv.dtype)
        o = (probs.view(B, n, g * T, S) @ c_kv).view(B, h, T, self.d_c)  # [B, h, T, d_c]: weighted latents
        return torch.einsum("bhtc,hvc->bthv", o, w_uv)  # [B, T, h, d_v]: W_UV applied after attention
