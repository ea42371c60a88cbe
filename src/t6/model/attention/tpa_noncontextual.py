"""TPA with non-contextual factors (paper §3.4): one of the two factors is a learned constant.

- tpa_nc_a: head factors A_Q, A_K, A_V are parameters [R, h]; token factors B(x_t) stay
  contextual. Q_t = (1/R_Q) A_Q^T B_Q(x_t). With R = h and A = R * I this is exactly MHA
  (§3.4.1): head i's query is B_Q(x_t)[i] = (W_Q x_t)_i.
  Cached per token and layer: the rotated B_K and B_V, (R_K + R_V) d_h numbers.
- tpa_nc_b: token factors B_Q, B_K, B_V are parameters [R, d_h]; head factors A(x_t) stay
  contextual. RoPE rotates the constant B_Q, B_K at each position, so the keys are
  rebuilt from the cached A_K and the position alone.
  Cached per token and layer: A_K and A_V, (R_K + R_V) h numbers.

Both keep RoPE on the token-dimension factor, so Theorem 1 (logits depend on relative
position only) holds. Ranks and the constant factor: `NonContextualOptions`.

Initialization: Xavier-uniform on the contextual factor maps (as `tpa`) and on the constant
factors; zero W_O.
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
class NonContextualOptions(Options):
    q_rank: int = 6  # R_Q
    k_rank: int = 2  # R_K
    v_rank: int = 2  # R_V
    constant: str = "a"  # the factor that is a learned constant: "a" (head factors) or "b" (token factors)

    def problems(self, cfg) -> list[str]:
        problems = super().problems(cfg)
        if self.constant not in ("a", "b"):
            problems.append(f"attention.options.constant={self.constant!r} must be 'a' or 'b'")
        return problems


class ConstantFactor(nn.Module):
    """A learned factor [R, n] that does not depend on the token."""

    def __init__(self, rank: int, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rank, n))

    def forward(self) -> torch.Tensor:
        return self.weight  # [R, n]


@register("tpa_nc_a", constant="a")
@register("tpa_nc_b", constant="b")
class NonContextualTPA(Attention):
    Options = NonContextualOptions
    supports_key_mask = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        h, d = cfg.n_head, cfg.head_dim
        self.const_a = self.opts.constant == "a"
        self.ranks = {"q": self.opts.q_rank, "k": self.opts.k_rank, "v": self.opts.v_rank}
        const_n, ctx_n = (h, d) if self.const_a else (d, h)
        self.const = nn.ModuleDict({n: ConstantFactor(r, const_n) for n, r in self.ranks.items()})
        self.ctx_n = ctx_n  # the contextual factors' width: d_h (nc_a) or h (nc_b)
        self.ctx = nn.ModuleDict({n: nn.Linear(cfg.d_model, r * ctx_n, bias=False) for n, r in self.ranks.items()})
        self.out = nn.Linear(h * d, cfg.d_model, bias=False)
        self.rope = Rotary(d, cfg.block_size, cfg.rope_theta, cfg.rope_remap)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Xavier-uniform on the contextual factor maps and the constant factors, zero W_O."""
        super().init_weights()
        for module in (*self.const.values(), *self.ctx.values()):
            nn.init.xavier_uniform_(module.weight)

    def cache_spec(self) -> dict[str, tuple[int, ...]]:
        n = self.cfg.head_dim if self.const_a else self.cfg.n_head
        return {"k": (self.ranks["k"], n), "v": (self.ranks["v"], n)}

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        ctx = {n: m(x).view(B, T, self.ranks[n], self.ctx_n) for n, m in self.ctx.items()}  # [B, T, R, d_h or h]
        if self.const_a:
            ctx["q"], ctx["k"] = self.rope(ctx["q"], pos), self.rope(ctx["k"], pos)  # rotate B_Q, B_K
        k, v = ctx["k"], ctx["v"]
        kv_pos = pos
        if cache is not None:
            k, v = cache.update(pos, k=k, v=v)  # [B, S, R, *] each
            kv_pos = torch.arange(k.shape[1], device=x.device)  # [S]
        q = self.expand("q", ctx["q"], pos)  # [B, T, h, d_h]
        k = self.expand("k", k, kv_pos)  # [B, S, h, d_h]
        v = self.expand("v", v, None)  # [B, S, h, d_h]
        y = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), pos, cache)  # [B, h, T, d_h]
        return self.project(y.transpose(1, 2).reshape(B, T, -1), x)  # [B, T, d_model]

    def cached_keys_values(self, cache: KVCache, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        views = cache.views(end)
        k = self.expand("k", views["k"], torch.arange(end, device=views["k"].device))  # [B, end, h, d_h]
        v = self.expand("v", views["v"], None)  # [B, end, h, d_h]
        return k.transpose(1, 2), v.transpose(1, 2)  # [B, h, end, d_h] each

    def expand(self, name: str, factor: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
        """(1/R) A^T B from the contextual factor [B, T, R, *] and the constant one -> [B, T, h, d_h]."""
        const = self.const[name]()  # [R, h] (nc_a) or [R, d_h] (nc_b)
        rank = const.shape[0]
        if self.const_a:
            return torch.einsum("rh,btrd->bthd", const, factor) / rank  # B already rotated
        if pos is not None:  # the constant B_Q / B_K rotated to each position
            const = self.rope(const[None, None], pos)[
                0
            ]  # [1, 1, R, d_h] broadcast against [1, T, 1, d_h/2] -> [T, R, d_h]
            return torch.einsum("btrh,trd->bthd", factor, const) / rank
        return torch.einsum("btrh,rd->bthd", factor, const) / rank
