"""Building blocks shared by every T6 variant: RMSNorm, SwiGLU and rotary position embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """LLaMA feed-forward: W_down(silu(W_gate x) * W_up x), hidden width ~ 8/3 d."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, T, d] -> [B, T, hidden] -> [B, T, d]
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Rotary(nn.Module):
    """Rotary position embedding (RoPE) over the last dimension of a tensor.

    Rotates pairs (x_i, x_{i+dim/2}) by the angle pos * theta^(-2i/dim), so that the dot
    product of two rotated vectors depends only on their position difference.
    """

    def __init__(self, dim: int, max_len: int, theta: float = 10000.0):
        super().__init__()
        if dim % 2:
            raise ValueError(f"RoPE dimension must be even, got {dim}")
        self.dim, self.max_len, self.theta = dim, max_len, theta
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # [dim/2]
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [max_len, dim/2]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: [B, T, n, dim] (any number of 'n' slots: heads or factor ranks); pos: [T] absolute positions."""
        cos = self.cos[pos].to(x.dtype)[None, :, None, :]  # [1, T, 1, dim/2]
        sin = self.sin[pos].to(x.dtype)[None, :, None, :]  # [1, T, 1, dim/2]
        x1, x2 = x.chunk(2, dim=-1)  # 2 x [B, T, n, dim/2]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # [B, T, n, dim]
