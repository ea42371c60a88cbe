"""Tensor Product Attention (TPA, arXiv 2501.06425 §3) and TPA-KVonly.

Each token's query, key and value are sums of rank-one tensor products of a head factor
A(x_t) in R^{R x h} and a token-dimension factor B(x_t) in R^{R x d_h}, both linear in x_t:

    Q_t = (1/R_Q) A_Q(x_t)^T B_Q(x_t)   (same for K with R_K, V with R_V)      [h, d_h]

RoPE is applied to B_Q and B_K before the contraction (§3.2, Theorem 1), so keys are
cached pre-rotated. Defaults R_Q=6, R_K=R_V=2. `tpa_kvonly` keeps a standard query
projection and factorizes K and V only.

Cached per token and layer: A_K, B_K, A_V, B_V, that is (R_K + R_V)(h + d_h) numbers
(paper Table 1), for both `tpa` and `tpa_kvonly`.

Initialization (following the reference recipe): Xavier-uniform on the factor maps
W_A and W_B; the output projection W_O is zero-initialized like every residual output.
"""

from __future__ import annotations

import torch
from torch import nn

from t6.model.attention.base import Attention, KVCache, register
from t6.model.config import ModelConfig
from t6.model.layers import Rotary


class Factor(nn.Module):
    """x [B, T, d_model] -> A [B, T, R, h] and B [B, T, R, d_h]: the two factors of one of Q, K, V."""

    def __init__(self, d_model: int, rank: int, n_head: int, head_dim: int):
        super().__init__()
        self.rank, self.n_head, self.head_dim = rank, n_head, head_dim
        self.a = nn.Linear(d_model, rank * n_head, bias=False)
        self.b = nn.Linear(d_model, rank * head_dim, bias=False)
        for lin in (self.a, self.b):
            lin.xavier_init = True

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        a = self.a(x).view(B, T, self.rank, self.n_head)  # [B, T, R, h]
        b = self.b(x).view(B, T, self.rank, self.head_dim)  # [B, T, R, d_h]
        return a, b


def contract(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(1/R) A^T B per token: a [B, T, R, h], b [B, T, R, d_h] -> [B, T, h, d_h]."""
    return torch.einsum("btrh,btrd->bthd", a, b) / a.shape[2]


@register("tpa", "tpa_kvonly")
class TensorProductAttention(Attention):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        h, d = cfg.n_head, cfg.head_dim
        self.k_rank, self.v_rank = cfg.option("k_rank", 2), cfg.option("v_rank", 2)
        self.kv_only = cfg.attention == "tpa_kvonly"
        if self.kv_only:
            self.q = nn.Linear(cfg.d_model, h * d, bias=False)
        else:
            self.q = Factor(cfg.d_model, cfg.option("q_rank", 6), h, d)
        self.k = Factor(cfg.d_model, self.k_rank, h, d)
        self.v = Factor(cfg.d_model, self.v_rank, h, d)
        self.out = nn.Linear(h * d, cfg.d_model, bias=False)
        self.out.is_residual_out = True
        self.rope = Rotary(d, cfg.block_size, cfg.rope_theta)

    @classmethod
    def check_config(cls, cfg: ModelConfig) -> list[str]:
        problems = []
        for name, default in (("q_rank", 6), ("k_rank", 2), ("v_rank", 2)):
            value = cfg.option(name, default)
            if not isinstance(value, int) or value <= 0:
                problems.append(f"attention.options.{name}={value!r} must be a positive integer")
        return problems

    def cache_spec(self) -> dict[str, tuple[int, ...]]:
        h, d = self.cfg.n_head, self.cfg.head_dim
        return {"a_k": (self.k_rank, h), "b_k": (self.k_rank, d), "a_v": (self.v_rank, h), "b_v": (self.v_rank, d)}

    def query(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [B, T, d_model] -> rotated queries [B, T, h, d_h]."""
        if self.kv_only:
            B, T, _ = x.shape
            return self.rope(self.q(x).view(B, T, self.cfg.n_head, self.cfg.head_dim), pos)  # [B, T, h, d_h]
        a_q, b_q = self.q(x)  # [B, T, R_Q, h], [B, T, R_Q, d_h]
        return contract(a_q, self.rope(b_q, pos))  # [B, T, h, d_h]

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.query(x, pos)  # [B, T, h, d_h]
        a_k, b_k = self.k(x)  # [B, T, R_K, h], [B, T, R_K, d_h]
        b_k = self.rope(b_k, pos)  # keys rotated once, before caching
        a_v, b_v = self.v(x)  # [B, T, R_V, h], [B, T, R_V, d_h]
        if cache is not None:
            a_k, b_k, a_v, b_v = cache.update(pos, a_k=a_k, b_k=b_k, a_v=a_v, b_v=b_v)  # [B, S, R, *] each
        k = contract(a_k, b_k)  # [B, S, h, d_h]
        v = contract(a_v, b_v)  # [B, S, h, d_h]
        y = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), pos, cache is not None)  # [B, h, T, d_h]
        return self.out(y.transpose(1, 2).reshape(B, T, -1))  # [B, T, d_model]
