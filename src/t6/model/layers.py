"""Building blocks shared by every T6 variant: RMSNorm, SwiGLU and rotary position embeddings."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from t6.model.attention.base import stackable


class SwiGLU(nn.Module):
    """LLaMA feed-forward: W_down(silu(W_gate x) * W_up x), hidden width ~ 8/3 d."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def stackable(self) -> dict[str, tuple[nn.Module, ...]]:
        """W_gate and W_up as one matmul in a fixed-shape decode step (t6.model.attention.base.stackable)."""
        return stackable(gate_up=(self.gate, self.up))

    def forward(self, x: torch.Tensor, stacked=None) -> torch.Tensor:
        """x: [B, T, d] -> [B, T, hidden] -> [B, T, d]; stacked: W_gate and W_up as one matmul (a StackedLinear)."""
        gate, up = (self.gate(x), self.up(x)) if stacked is None else stacked(x)  # [B, T, hidden] each
        return self.down(F.silu(gate) * up)


def rope_frequencies(dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """The inverse frequencies theta^(-2i/dim) of the dim/2 rotated pairs [dim/2], fp32; with scaling
    (ModelConfig.rope_remap, rope_type llama3), Llama 3's remap as transformers computes it: wavelengths
    longer than original_max_position_embeddings / low_freq_factor are stretched by `factor`, shorter than
    original / high_freq_factor kept, those between interpolated smoothly."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))  # [dim/2]
    if not scaling:
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq  # [dim/2]
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)  # [dim/2]
    smooth = (context / wavelen - low) / (high - low)  # [dim/2]
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled  # [dim/2]
    medium = ~(wavelen < context / high) * ~(wavelen > context / low)  # [dim/2]
    return torch.where(medium, smoothed, scaled)  # [dim/2]


class Rotary(nn.Module):
    """Rotary position embedding (RoPE) over the last dimension of a tensor.

    Rotates pairs (x_i, x_{i+dim/2}) by the angle pos * inv_freq_i (`rope_frequencies`: theta^(-2i/dim),
    remapped by Llama 3's scaling when given), so that the dot product of two rotated vectors depends only
    on their position difference. The pairs are halves, as in Hugging Face's Llama (`rotate_half`), so its
    query and key projections load unpermuted.
    """

    def __init__(self, dim: int, max_len: int, theta: float = 10000.0, scaling: dict | None = None):
        super().__init__()
        if dim % 2:
            raise ValueError(f"RoPE dimension must be even, got {dim}")
        self.dim, self.max_len, self.theta, self.scaling = dim, max_len, theta, scaling
        inv_freq = rope_frequencies(dim, theta, scaling)  # [dim/2]
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [max_len, dim/2]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: [B, T, n, dim] (any number of 'n' slots: heads or factor ranks); pos: [T] absolute positions."""
        cos = self.cos[pos].to(x.dtype)[None, :, None, :]  # [1, T, 1, dim/2]
        sin = self.sin[pos].to(x.dtype)[None, :, None, :]  # [1, T, 1, dim/2]
        x1, x2 = x.chunk(2, dim=-1)  # 2 x [B, T, n, dim/2]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # [B, T, n, dim]
