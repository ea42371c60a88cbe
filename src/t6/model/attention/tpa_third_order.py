"""Third-order TPA (paper §3.5, higher-order factorization).

Each of Q, K, V is a sum of rank-one third-order tensors: a head factor a_r(x_t) in R^h and
two token-dimension factors b_r(x_t) in R^{d_b}, c_r(x_t) in R^{d_c} with d_b * d_c = d_h:

    Q_t[i, (j, k)] = (1/R_Q) sum_r a_r[i] b_r[j] c_r[k]      -> [h, d_h]  ((j, k) flattened)

RoPE (over d_b dimensions) rotates b of queries and keys. Because q . k then factorizes as
sum_{r,r'} (a_r . a_r') (R_m b_r . R_n b_r') (c_r . c_r'), the logits depend on m - n only
(Theorem 1 carries over). Options: q_rank/k_rank/v_rank (6/2/2) and c_dim = d_c (4, so
d_b = 16 at d_h = 64).

Cached per token and layer: a, rotated b and c for K and V, (R_K + R_V)(h + d_b + d_c)
numbers, against (R_K + R_V)(h + d_h) for `tpa`.

Initialization: Xavier-uniform factor maps, zero W_O (as `tpa`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from t6.model.attention.base import Attention, KVCache, Options, register
from t6.model.layers import Rotary

if TYPE_CHECKING:  # the model config imports the registry; type hints only
    from t6.model.config import ModelConfig


@dataclass
class ThirdOrderOptions(Options):
    q_rank: int = 6  # R_Q
    k_rank: int = 2  # R_K
    v_rank: int = 2  # R_V
    c_dim: int = 4  # d_c; d_b = head_dim / c_dim

    def problems(self, cfg: ModelConfig) -> list[str]:
        problems = super().problems(cfg)
        c = self.c_dim
        if not problems and (cfg.head_dim % c or (cfg.head_dim // c) % 2):
            problems.append(
                f"attention.options.c_dim={c} must divide size.head_dim={cfg.head_dim} into an even d_b (RoPE on b)"
            )
        return problems


class Factor3(nn.Module):
    """x [B, T, d_model] -> a [B, T, R, h], b [B, T, R, d_b], c [B, T, R, d_c]."""

    def __init__(self, d_model: int, rank: int, dims: tuple[int, int, int]):
        super().__init__()
        self.rank, self.dims = rank, dims
        self.maps = nn.ModuleList(nn.Linear(d_model, rank * n, bias=False) for n in dims)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        B, T, _ = x.shape
        return [m(x).view(B, T, self.rank, n) for m, n in zip(self.maps, self.dims)]


def contract3(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """(1/R) sum_r a_r x b_r x c_r: [B, T, R, h], [B, T, R, d_b], [B, T, R, d_c] -> [B, T, h, d_b * d_c]."""
    B, T, R, h = a.shape
    return (torch.einsum("btrh,btrj,btrk->bthjk", a, b, c) / R).reshape(B, T, h, -1)


@register("tpa_third_order")
class ThirdOrderTPA(Attention):
    Options = ThirdOrderOptions
    supports_key_mask = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        h = cfg.n_head
        self.d_c = self.opts.c_dim
        self.d_b = cfg.head_dim // self.d_c
        self.ranks = {"q": self.opts.q_rank, "k": self.opts.k_rank, "v": self.opts.v_rank}
        self.q = Factor3(cfg.d_model, self.ranks["q"], (h, self.d_b, self.d_c))
        self.k = Factor3(cfg.d_model, self.ranks["k"], (h, self.d_b, self.d_c))
        self.v = Factor3(cfg.d_model, self.ranks["v"], (h, self.d_b, self.d_c))
        self.out = nn.Linear(h * cfg.head_dim, cfg.d_model, bias=False)
        self.rope = Rotary(self.d_b, cfg.block_size, cfg.rope_theta, cfg.rope_remap)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Xavier-uniform on the factor maps, zero W_O (as `tpa`)."""
        super().init_weights()
        for factor in (self.q, self.k, self.v):
            for lin in factor.maps:
                nn.init.xavier_uniform_(lin.weight)

    def cache_spec(self) -> dict[str, tuple[int, ...]]:
        h = self.cfg.n_head
        spec = {}
        for n in ("k", "v"):
            r = self.ranks[n]
            spec.update({f"a_{n}": (r, h), f"b_{n}": (r, self.d_b), f"c_{n}": (r, self.d_c)})
        return spec

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        a_q, b_q, c_q = self.q(x)  # [B, T, R_Q, h | d_b | d_c]
        q = contract3(a_q, self.rope(b_q, pos), c_q)  # [B, T, h, d_h]
        a_k, b_k, c_k = self.k(x)  # [B, T, R_K, h | d_b | d_c]
        b_k = self.rope(b_k, pos)  # keys rotated once, before caching
        a_v, b_v, c_v = self.v(x)  # [B, T, R_V, h | d_b | d_c]
        if cache is not None:
            a_k, b_k, c_k, a_v, b_v, c_v = cache.update(
                pos, a_k=a_k, b_k=b_k, c_k=c_k, a_v=a_v, b_v=b_v, c_v=c_v
            )  # [B, S, R, *] each
        k, v = self.keys_values(a_k, b_k, c_k, a_v, b_v, c_v)  # [B, h, S, d_h] each
        y = self.attend(q.transpose(1, 2), k, v, pos, cache)  # [B, h, T, d_h]
        return self.project(y.transpose(1, 2).reshape(B, T, -1), x)  # [B, T, d_model]

    @staticmethod
    def keys_values(a_k, b_k, c_k, a_v, b_v, c_v) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V contracted from their three factors [B, S, R, *] -> [B, h, S, d_h] each."""
        return contract3(a_k, b_k, c_k).transpose(1, 2), contract3(a_v, b_v, c_v).transpose(1, 2)

    def cached_keys_values(self, cache: KVCache, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        views = cache.views(end)
        return self.keys_values(*(views[n] for n in ("a_k", "b_k", "c_k", "a_v", "b_v", "c_v")))  # [B, h, end, d_h]
