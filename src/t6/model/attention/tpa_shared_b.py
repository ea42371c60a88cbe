"""TPA with the token-dimension factor B shared by keys and values (paper §3.4).

    K_t = (1/R) A_K(x_t)^T R_t B(x_t),   V_t = (1/R) A_V(x_t)^T B(x_t)

Queries are factorized as in `tpa` (R_Q=6). Keys and values have their own head factors
A_K, A_V but one token factor B (rank R = kv_rank, default 2); RoPE rotates B for the keys
only (values must not depend on position), so B is cached unrotated and rotated at the
cached positions when keys are built. Theorem 1 holds (RoPE acts on B_Q and B only).

Cached per token and layer: A_K, A_V and B, R (2h + d_h) numbers
(against (R_K + R_V)(h + d_h) for `tpa`).

Initialization: Xavier-uniform factor maps, zero W_O (as `tpa`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from t6.model.attention.base import Attention, KVCache, Options, register
from t6.model.attention.tpa import Factor, contract
from t6.model.layers import Rotary

if TYPE_CHECKING:  # the model config imports the registry; type hints only
    from t6.model.config import ModelConfig


@dataclass
class SharedBOptions(Options):
    q_rank: int = 6  # R_Q
    kv_rank: int = 2  # R, the rank of K and of V


@register("tpa_shared_b")
class SharedBTPA(Attention):
    Options = SharedBOptions
    supports_key_mask = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        h, d = cfg.n_head, cfg.head_dim
        self.rank = self.opts.kv_rank
        self.q = Factor(cfg.d_model, self.opts.q_rank, h, d)
        self.a_k = nn.Linear(cfg.d_model, self.rank * h, bias=False)
        self.a_v = nn.Linear(cfg.d_model, self.rank * h, bias=False)
        self.b = nn.Linear(cfg.d_model, self.rank * d, bias=False)
        self.out = nn.Linear(h * d, cfg.d_model, bias=False)
        self.rope = Rotary(d, cfg.block_size, cfg.rope_theta, cfg.rope_remap)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Xavier-uniform on every factor map, zero W_O (as `tpa`)."""
        super().init_weights()
        self.q.init_weights()
        for lin in (self.a_k, self.a_v, self.b):
            nn.init.xavier_uniform_(lin.weight)

    def cache_spec(self) -> dict[str, tuple[int, ...]]:
        h, d = self.cfg.n_head, self.cfg.head_dim
        return {"a_k": (self.rank, h), "a_v": (self.rank, h), "b": (self.rank, d)}

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        h, d = self.cfg.n_head, self.cfg.head_dim
        a_q, b_q = self.q(x)  # [B, T, R_Q, h], [B, T, R_Q, d_h]
        q = contract(a_q, self.rope(b_q, pos))  # [B, T, h, d_h]
        a_k = self.a_k(x).view(B, T, self.rank, h)  # [B, T, R, h]
        a_v = self.a_v(x).view(B, T, self.rank, h)  # [B, T, R, h]
        b = self.b(x).view(B, T, self.rank, d)  # [B, T, R, d_h], unrotated
        kv_pos = pos
        if cache is not None:
            a_k, a_v, b = cache.update(pos, a_k=a_k, a_v=a_v, b=b)  # [B, S, R, *] each
            kv_pos = torch.arange(b.shape[1], device=x.device)  # [S]
        k, v = self.keys_values(a_k, a_v, b, kv_pos)  # [B, h, S, d_h] each
        y = self.attend(q.transpose(1, 2), k, v, pos, cache)  # [B, h, T, d_h]
        return self.project(y.transpose(1, 2).reshape(B, T, -1), x)  # [B, T, d_model]

    def keys_values(self, a_k, a_v, b, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys from the head factors A_K [B, S, R, h] and the token factor B [B, S, R, d_h] rotated to its positions
        pos [S], values from A_V and the same B unrotated -> [B, h, S, d_h] each."""
        k = contract(a_k, self.rope(b, pos))  # [B, S, h, d_h]
        v = contract(a_v, b)  # [B, S, h, d_h]
        return k.transpose(1, 2), v.transpose(1, 2)

    def cached_keys_values(self, cache: KVCache, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        views = cache.views(end)
        pos = torch.arange(end, device=views["b"].device)  # [end]
        return self.keys_values(views["a_k"], views["a_v"], views["b"], pos)  # [B, h, end, d_h] each
