"""Differential attention (DIFF Transformer, Ye et al., ICLR 2025, arXiv 2410.05258; its V1, the published
formulation: docs/attention.md says why not V2).

Each of the h heads computes two softmax maps over the same values and subtracts them, cancelling the attention
both maps put on the same (irrelevant) context:

    [Q1 | Q2] = x W_Q,  [K1 | K2] = x W_K      per head: Q1, Q2, K1, K2 [d_h], RoPE on each
    V = x W_V                                  per head [2 d_h]
    head i:  (softmax(Q1 K1^T / sqrt(d_h)) - lambda softmax(Q2 K2^T / sqrt(d_h))) V
    lambda = exp(l_q1 . l_k1) - exp(l_q2 . l_k2) + lambda_init      l_* [d_h], learned, shared by the heads
    lambda_init = 0.8 - 0.6 exp(-0.3 l)        l the layer's index from 0 (the paper's l - 1)
    out = W_O concat_i((1 - lambda_init) RMSNorm(head_i))        RMSNorm over each head's 2 d_h (one per head)

Each head has two maps of width d_h and a value of 2 d_h, so h DIFF heads have the parameters and the KV cache of
2h MHA heads: `conf/attention/diff.yaml` gives MHA's heads / 2 per size (the paper's h = d_model / 2d).
The subtraction is linear in the maps and the values' halves are separate columns, so the layer is four causal
softmax attentions of h heads of width d_h (each map over each half of V, as the reference's flashdiff_1), the
difference taken after: `Attention.attend` (SDPA, the cache's masks, the kernels of each phase), no custom
kernel, and every kernel's equal query, key and value widths (a 2 d_h value would rule out SDPA's flash kernels
and fall back to the one that holds [T, S] scores).

Cached per token and layer: K1, K2 and V's two halves, 2 h d_h + 2 h d_h = 4 h d_h numbers (MHA with 2h heads).

Initialization: N(0, init_std) on the projections, zero W_O, ones on the per-head norm (`Attention.init_weights`),
N(0, 0.1) on the lambda vectors (the reference code's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from t6.model.attention.base import Attention, KVCache, Options, register
from t6.model.layers import Rotary

if TYPE_CHECKING:  # the model config imports the registry; type hints only
    from t6.model.config import ModelConfig


@dataclass
class DiffOptions(Options):
    lambda_init: float | None = None  # None: the paper's schedule by depth; a number: that constant (its ablation)


def lambda_init_at(depth: int) -> float:
    """The paper's lambda_init of the layer at index `depth` (from 0): 0.8 - 0.6 exp(-0.3 depth)."""
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


@register("diff")
class DifferentialAttention(Attention):
    Options = DiffOptions
    supports_key_mask = True
    # K1, K2 ([B, 2h, max_len, d_h]: the h heads' K1, then their K2) and V ([B, 2h, max_len, d_h]: every head's
    # first half, then the second halves) head-major, each map's keys and each half's values one contiguous block.
    head_major_cache = ("k", "v")

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        h, d = cfg.n_head, cfg.head_dim
        self.q = nn.Linear(cfg.d_model, 2 * h * d, bias=False)  # [Q1 of every head | Q2 of every head]
        self.k = nn.Linear(cfg.d_model, 2 * h * d, bias=False)  # [K1 | K2]
        self.v = nn.Linear(cfg.d_model, h * 2 * d, bias=False)
        self.out = nn.Linear(h * 2 * d, cfg.d_model, bias=False)
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (nn.Parameter(torch.empty(d)) for _ in "1234")
        self.head_norm = nn.RMSNorm(2 * d, eps=cfg.norm_eps)  # each head's output on its own
        self.rope = Rotary(d, cfg.block_size, cfg.rope_theta, cfg.rope_remap)
        # lambda_init as a tensor []: data, not a constant of the code, so the blocks (each its own value) share one
        # compiled graph. Filled from `depth` (which T6 sets once the blocks exist) by init_weights.
        self.register_buffer("lambda_init_value", torch.tensor(self.lambda_init()), persistent=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, init_std) on the projections, ones on the head norm, zero W_O; N(0, 0.1) on the lambda vectors;
        lambda_init of this layer's depth."""
        super().init_weights()
        for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            nn.init.normal_(p, mean=0.0, std=0.1)
        self.lambda_init_value.fill_(self.lambda_init())

    def cache_spec(self) -> dict[str, tuple[int, ...]]:
        h, d = self.cfg.n_head, self.cfg.head_dim
        return {"k": (2 * h, d), "v": (2 * h, d)}

    def cached_keys_values(self, cache: KVCache, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        views = cache.views(end)
        return views["k"], views["v"]  # [B, 2h, end, d] each: K1 heads then K2; values' first halves then second

    def lambda_init(self) -> float:
        given = self.opts.lambda_init
        return lambda_init_at(self.depth) if given is None else float(given)

    def over_values(self, q, k, v, pos: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """One softmax map, q [B, h, T, d] against k [B, h, S, d], over both halves of the values v [B, 2h, S, d]
        (every head's first half, then the second halves) -> [B, h, T, 2d]."""
        h = q.shape[1]
        halves = [self.attend(q, k, v[:, :h], pos, cache), self.attend(q, k, v[:, h:], pos, cache)]  # [B, h, T, d] x 2
        return torch.cat(halves, dim=-1)  # [B, h, T, 2d]

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        h, d = self.cfg.n_head, self.cfg.head_dim
        q = self.rope(self.q(x).view(B, T, 2 * h, d), pos).transpose(1, 2)  # [B, 2h, T, d]: Q1 heads, then Q2
        k = self.rope(self.k(x).view(B, T, 2 * h, d), pos)  # [B, T, 2h, d]
        v = self.v(x).view(B, T, h, 2, d).transpose(2, 3).flatten(2, 3)  # [B, T, 2h, d]: first halves, then second
        if cache is not None:
            k, v = cache.update(pos, k=k, v=v)  # [B, 2h, S, d] each (head-major), S = pos[-1] + 1
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, 2h, T, d] each
        first = self.over_values(q[:, :h], k[:, :h], v, pos, cache)  # softmax(Q1 K1^T / sqrt(d)) V: [B, h, T, 2d]
        second = self.over_values(q[:, h:], k[:, h:], v, pos, cache)  # softmax(Q2 K2^T / sqrt(d)) V: [B, h, T, 2d]
        lam_init = self.lambda_init_value  # []
        lam = (
            torch.exp(torch.dot(self.lambda_q1, self.lambda_k1))
            - torch.exp(torch.dot(self.lambda_q2, self.lambda_k2))
            + lam_init
        )  # []
        y = first - lam * second  # [B, h, T, 2d]
        if self.recorded:  # the four attentions attend recorded, as the one map the layer applies (none: not kept)
            p1, _, p2, _ = self.recorded[-4:]  # [B, h, T, S] each: each map twice (over both halves of V)
            del self.recorded[-4:]
            combined = p1 - lam * p2  # [B, h, T, S]
            self.recorded.append(combined)
            values = torch.cat([v[:, :h], v[:, h:]], dim=-1)  # [B, h, S, 2d]: each head's whole value
            y = (combined.to(v.dtype) @ values).to(q.dtype)  # [B, h, T, 2d]: the same y, from the map recorded
        y = self.head_norm(y) * (1 - lam_init)  # [B, h, T, 2d]
        return self.project(y.transpose(1, 2).reshape(B, T, h * 2 * d), x)  # [B, T, d_model]
