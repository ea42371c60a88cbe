"""Multi-head Latent Attention (MLA, DeepSeek-V2, arXiv 2405.04434 §2.1).

Queries and keys/values are first compressed into low-rank latents, normalized, then expanded:

    c_q  = RMSNorm(W_DQ x)                       [d_cq]
    q    = W_UQ c_q  -> per head [q_nope (d_nope) | q_rope (d_rope)]
    c_kv, k_rope = split(W_DKV x)                [d_c], [d_rope]  (k_rope shared by all heads)
    c_kv = RMSNorm(c_kv)
    k_nope, v = split(W_UKV c_kv) per head       [d_nope], [d_v]
    head i:  softmax([q_nope_i | R_t q_rope_i] . [k_nope_i | R_s k_rope] / sqrt(d_nope + d_rope)) v_i

RoPE is "decoupled": only the d_rope part of queries and the one shared key k_rope rotate.

Cached per token and layer: the normalized KV latent c_kv and the rotated shared key k_rope,
d_c + d_rope numbers (paper Table 1), never per-head K/V. With a cache, decoding uses the
absorbed form: W_UK is folded into the query (q_nope W_UK gives a d_c-wide query that
scores c_kv directly) and W_UV into the output (attention averages c_kv, W_UV expands the
result), so per-head keys and values are never materialized. Training (no cache) uses the
explicit up-projections, and so does a prefill into an empty cache (SDPA's flash kernel: the absorbed form
would hold [B, h, T, S] scores, 49 GB at 32k tokens). Both are the same function (tests/test_model.py checks it).

Initialization: N(0, init_std) on every projection, zero W_O (`Attention.init_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from t6.model.attention.base import Attention, KVCache, Options, linear_weight, register, sdpa, stackable
from t6.model.attention.fused_decode import latent_decode
from t6.model.layers import Rotary

if TYPE_CHECKING:  # the model config imports the registry; type hints only
    from t6.model.config import ModelConfig


def latent_keys(k_nope: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """Per-head keys [k_nope_i | k_rope] [B, S, h, nope+rope] of the latent attentions (MLA, GLA): k_nope [B, S, h,
    nope] expanded from the latent, k_rope [B, S, rope] the one RoPE key shared by all heads."""
    B, S, h, _ = k_nope.shape
    return torch.cat([k_nope, k_rope[:, :, None].expand(B, S, h, k_rope.shape[-1])], dim=-1)  # [B, S, h, nope+rope]


def explicit_attention(attn: Attention, q_nope, q_rope, k_nope, v, k_rope, scale: float) -> torch.Tensor:
    """Causal SDPA of per-head queries [q_nope | q_rope] [B, T, h, *] against per-head keys
    [k_nope | k_rope] (k_rope [B, S, d_rope] shared by all heads) and values v [B, S, h, d_v]
    -> [B, T, h, d_v]: the training path of the latent attentions (MLA, GLA), whose attention `attn` is
    (written out while it records its probabilities)."""
    B, S, h, d_v = v.shape
    q = torch.cat([q_nope, q_rope], dim=-1)  # [B, T, h, nope+rope]
    k = latent_keys(k_nope, k_rope)  # [B, S, h, nope+rope]
    if attn.recorded is not None:
        causal = torch.ones(q.shape[1], S, dtype=torch.bool, device=q.device).tril()[None]  # [1, T, S]
        y = attn.record_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, scale)
        return y.transpose(1, 2)  # [B, T, h, d_v]
    if d_v < q.shape[-1]:  # flash kernels need one head width: pad V with zeros, slice the output
        v = F.pad(v, (0, q.shape[-1] - d_v))  # [B, S, h, nope+rope]
    causal = True if q.shape[1] > 1 else False  # a branch, so a Python bool also under dynamic shapes (a guard)
    y = sdpa(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=scale
    )  # [B, h, T, max(d_v, nope+rope)]
    return y[..., :d_v].transpose(1, 2)  # [B, T, h, d_v]


@dataclass
class MLAOptions(Options):
    q_lora_rank: int = 512  # d_cq, the query latent
    kv_lora_rank: int = 256  # d_c, the cached KV latent
    rope_dim: int = 32  # d_h^R, the decoupled RoPE width (one key shared by all heads)
    nope_dim: int | None = None  # per-head no-RoPE query/key width; None: size.head_dim
    v_dim: int | None = None  # per-head value width; None: size.head_dim

    def problems(self, cfg) -> list[str]:
        problems = super().problems(cfg)
        if isinstance(self.rope_dim, int) and self.rope_dim % 2:
            problems.append(f"attention.options.rope_dim={self.rope_dim} must be even (RoPE rotates pairs)")
        return problems


@register("mla")
class MultiHeadLatentAttention(Attention):
    Options = MLAOptions
    supports_key_mask = True
    # Single-token cached steps run the fused operator t6::latent_decode (one pass over the
    # latents, online softmax; C++ on the CPU, Triton on CUDA) when True; False keeps the eager
    # absorbed form (the reference).
    fused_decode: bool = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        o, h = self.opts, cfg.n_head
        self.d_cq, self.d_c, self.d_rope = o.q_lora_rank, o.kv_lora_rank, o.rope_dim
        self.d_nope = o.nope_dim or cfg.head_dim  # per-head no-RoPE query/key width
        self.d_v = o.v_dim or cfg.head_dim
        self.q_down = nn.Linear(cfg.d_model, self.d_cq, bias=False)  # W_DQ
        self.q_norm = nn.RMSNorm(self.d_cq, eps=cfg.norm_eps)
        self.q_up = nn.Linear(self.d_cq, h * (self.d_nope + self.d_rope), bias=False)  # W_UQ and W_QR
        self.kv_down = nn.Linear(cfg.d_model, self.d_c + self.d_rope, bias=False)  # W_DKV and W_KR
        self.kv_norm = nn.RMSNorm(self.d_c, eps=cfg.norm_eps)
        self.kv_up = nn.Linear(self.d_c, h * (self.d_nope + self.d_v), bias=False)  # W_UK and W_UV
        self.out = nn.Linear(h * self.d_v, cfg.d_model, bias=False)
        self.rope = Rotary(self.d_rope, cfg.block_size, cfg.rope_theta, cfg.rope_remap)
        self.scale = (self.d_nope + self.d_rope) ** -0.5

    def stackable(self) -> dict[str, tuple[nn.Module, ...]]:
        return stackable(down=(self.q_down, self.kv_down))

    def cache_spec(self) -> dict[str, tuple[int, ...]]:
        return {"c_kv": (self.d_c,), "k_rope": (self.d_rope,)}

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.cfg.n_head
        stacked = None if cache is None else cache.stacked.get("down")
        q_lat, kv = (self.q_down(x), self.kv_down(x)) if stacked is None else stacked(x)  # both down maps: one matmul
        q = self.q_up(self.q_norm(q_lat)).view(B, T, h, self.d_nope + self.d_rope)  # [B, T, h, nope+rope]
        q_nope, q_rope = q.split([self.d_nope, self.d_rope], dim=-1)  # [B, T, h, nope], [B, T, h, rope]
        q_rope = self.rope(q_rope, pos)  # [B, T, h, rope]
        c_kv, k_rope = kv.split([self.d_c, self.d_rope], dim=-1)  # [B, T, d_c], [B, T, rope]
        c_kv = self.kv_norm(c_kv)  # [B, T, d_c]
        k_rope = self.rope(k_rope[:, :, None], pos)[:, :, 0]  # [B, T, rope], one key shared by all heads
        if cache is None:
            y = self._explicit(q_nope, q_rope, c_kv, k_rope)  # [B, T, h, d_v]
        elif T > 1 and cache.from_start(pos):  # a prefill: explicit and causal, SDPA's flash kernel, no [T, S] scores
            cache.update(pos, c_kv=c_kv, k_rope=k_rope)
            y = self._explicit(q_nope, q_rope, c_kv, k_rope)  # [B, T, h, d_v]
        else:
            c_kv, k_rope = cache.update(pos, c_kv=c_kv, k_rope=k_rope)  # [B, S, d_c], [B, S, rope]
            y = self._absorbed(q_nope, q_rope, c_kv, k_rope, cache, pos)  # [B, T, h, d_v]
        return self.project(y.reshape(B, T, h * self.d_v), x)  # [B, T, d_model]

    def _explicit(self, q_nope, q_rope, c_kv, k_rope) -> torch.Tensor:
        """Training path: expand the latent into per-head keys and values, then SDPA."""
        k_nope, v = self.expand_latent(c_kv)  # [B, S, h, nope], [B, S, h, d_v]
        return explicit_attention(self, q_nope, q_rope, k_nope, v, k_rope, self.scale)  # [B, T, h, d_v]

    def expand_latent(self, c_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The latent c_kv [B, S, d_c] through W_UK and W_UV -> per-head k_nope [B, S, h, nope], v [B, S, h, d_v]."""
        B, S, _ = c_kv.shape
        kv = self.kv_up(c_kv).view(B, S, self.cfg.n_head, self.d_nope + self.d_v)  # [B, S, h, nope+d_v]
        k_nope, v = kv.split([self.d_nope, self.d_v], dim=-1)  # [B, S, h, nope], [B, S, h, d_v]
        return k_nope, v

    def cached_keys_values(self, cache: KVCache, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        views = cache.views(end)
        k_nope, v = self.expand_latent(views["c_kv"])  # [B, end, h, nope], [B, end, h, d_v]
        k = latent_keys(k_nope, views["k_rope"])  # [B, end, h, nope+rope]
        return k.transpose(1, 2), v.transpose(1, 2)  # [B, h, end, nope+rope], [B, h, end, d_v]

    def _absorbed(self, q_nope, q_rope, c_kv, k_rope, cache: KVCache, pos: torch.Tensor) -> torch.Tensor:
        """Decoding path: attend over the cached latents with W_UK and W_UV absorbed (one shared KV 'head').
        The cache gives what the queries at pos may see: one new token's key mask and lengths for the fused operator
        (KVCache.decode_key_mask, KVCache.lengths), else the mask of `attn_mask` (causal, padding)."""
        h, T, S = self.cfg.n_head, q_nope.shape[1], c_kv.shape[1]
        w = linear_weight(self.kv_up, self.d_c).view(h, self.d_nope + self.d_v, self.d_c)  # [h, nope+d_v, d_c]
        w_uk, w_uv = w.split([self.d_nope, self.d_v], dim=1)  # [h, nope, d_c], [h, d_v, d_c]
        B = q_nope.shape[0]
        q_lat = torch.einsum("bthn,hnc->bhtc", q_nope, w_uk)  # [B, h, T, d_c]: q_nope^T W_UK
        if T == 1 and self.fused_decode and S > 1 and self.recorded is None:
            key_mask, lengths = cache.decode_key_mask(pos), cache.lengths(pos)  # [B, S] or None, [B] or None
            o = latent_decode(
                (q_lat * self.scale).reshape(B, h, self.d_c),
                (q_rope * self.scale).reshape(B, h, self.d_rope),
                c_kv,
                k_rope,
                key_mask,
                lengths,
            )  # [B, h, d_c]
            return torch.einsum("bhc,hvc->bhv", o, w_uv)[:, None]  # [B, 1, h, d_v]: W_UV applied after attention
        mask = cache.attn_mask(pos)  # [B or 1, T, S] or None
        # All heads share one key/value (the latent), so the heads become extra query rows of one
        # batched matmul: the cache is read once, never copied per head or concatenated.
        scores = q_lat.reshape(B, h * T, self.d_c) @ c_kv.transpose(1, 2)  # [B, h*T, S]: latent part
        scores = scores + q_rope.transpose(1, 2).reshape(B, h * T, self.d_rope) @ k_rope.transpose(
            1, 2
        )  # [B, h*T, S]: + RoPE part
        scores = scores.view(B, h, T, S) * self.scale  # [B, h, T, S]
        if mask is not None:  # causal among the new tokens, blind to padding
            scores = scores.masked_fill(~mask[:, None], float("-inf"))  # [B, h, T, S]
        probs = scores.float().softmax(dim=-1)  # [B, h, T, S]
        if self.recorded is not None:
            self.recorded.append(probs)
        probs = probs.to(c_kv.dtype)
        o = (probs.view(B, h * T, S) @ c_kv).view(B, h, T, self.d_c)  # [B, h, T, d_c]: attention-weighted latents
        return torch.einsum("bhtc,hvc->bthv", o, w_uv)  # [B, T, h, d_v]: W_UV applied after attention
