"""Model FLOPs, counted by PyTorch rather than by formula: `flops_per_token(model, seq_len)`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode


def flops_per_token(model: torch.nn.Module, seq_len: int, batch_size: int = 1, vocab_size: int | None = None) -> float:
    """FLOPs of one training step (forward + backward of next-token cross-entropy) per token, as
    counted by torch.utils.flop_counter.FlopCounterMode on a [batch_size, seq_len] batch
    (matmuls, and attention's QK^T and AV in full, causal mask or not; elementwise ops are not counted, as in
    the usual 6N + attention estimate).
    MFU = flops_per_token x tokens/s / peak FLOP/s. The model's gradients are left untouched."""
    vocab = vocab_size or model.cfg.vocab_size
    device = next(model.parameters()).device
    idx = torch.randint(0, vocab, (batch_size, seq_len + 1), device=device)
    saved = [p.grad for p in model.parameters()]
    counter = FlopCounterMode(display=False)
    # the math SDPA backend is made of matmuls the counter sees on every device (CPU's fused kernel is not counted)
    try:
        with counter, sdpa_kernel(SDPBackend.MATH):
            logits = model(idx[:, :-1])  # [B, T, V]
            F.cross_entropy(logits.flatten(0, 1).float(), idx[:, 1:].flatten()).backward()
    finally:
        for p, g in zip(model.parameters(), saved):
            p.grad = g
    return counter.get_total_flops() / (batch_size * seq_len)


def forward_flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """FLOPs of one forward pass per token, counted as in `flops_per_token`."""
    idx = torch.zeros(1, seq_len, dtype=torch.long, device=next(model.parameters()).device)
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):  # (no torch.no_grad: the counter's module hooks reject no-grad views)
        model(idx)
    return counter.get_total_flops() / seq_len
