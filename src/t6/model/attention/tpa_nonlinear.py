"""TPA with nonlinear head factors (paper §3.5): sigma(A) instead of A.

    Q_t = (1/R_Q) sigma(A_Q(x_t))^T B_Q(x_t)      (same for K and V)

- tpa_sigmoid: sigma = element-wise sigmoid, each rank gates every head in [0, 1];
- tpa_softmax: sigma = softmax over the h heads, each rank component distributes one unit
  of weight across heads ("mixture of heads").

Everything else is `tpa`: the same factor maps, ranks (`TPAOptions`), RoPE on B_Q and
B_K (Theorem 1 still holds, the nonlinearity acts on the head factor only) and forward.
Cached per token and layer: the activated A_K, A_V and B_K, B_V, (R_K + R_V)(h + d_h)
numbers, as `tpa`. Same parameters as `tpa`, so the same head counts.

Initialization: Xavier-uniform factor maps, zero W_O (as `tpa`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from t6.model.attention.base import register
from t6.model.attention.tpa import Factor, TensorProductAttention, TPAOptions

ACTIVATIONS = {"sigmoid": torch.sigmoid, "softmax": lambda a: a.softmax(dim=-1)}  # a: [B, T, R, h]


@dataclass
class NonlinearTPAOptions(TPAOptions):
    activation: str = "sigmoid"  # sigma on the head factors: sigmoid or softmax (over the heads)

    def problems(self, cfg) -> list[str]:
        problems = super().problems(cfg)
        if self.activation not in ACTIVATIONS:
            problems.append(f"attention.options.activation={self.activation!r} must be one of {sorted(ACTIVATIONS)}")
        return problems


class ActivatedFactor(Factor):
    """Factor whose head factor A goes through a nonlinearity: -> sigma(A) [B, T, R, h], B [B, T, R, d_h]."""

    def __init__(self, d_model: int, rank: int, n_head: int, head_dim: int, activation):
        super().__init__(d_model, rank, n_head, head_dim)
        self.activation = activation

    def head_factor(self, a: torch.Tensor) -> torch.Tensor:
        return self.activation(super().head_factor(a))  # sigma(A) [B, T, R, h]


@register("tpa_sigmoid", activation="sigmoid")
@register("tpa_softmax", activation="softmax")
class NonlinearHeadTPA(TensorProductAttention):
    Options = NonlinearTPAOptions

    def factor(self, d_model: int, rank: int, n_head: int, head_dim: int) -> ActivatedFactor:
        return ActivatedFactor(d_model, rank, n_head, head_dim, ACTIVATIONS[self.opts.activation])
