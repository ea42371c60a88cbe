"""What a conversion learns from calibration text: each layer's attention inputs and outputs in the source
model, their statistics (for the closed forms, t6.uptrain.closed_form), and layer-wise attention-output
distillation, which starts any mechanism, registered now or later, from a source model with no code of
its own.

    batches = calibration_batches(source, windows)      # each layer's attention input and output, kept
    stats = input_statistics(batches)                    # E[x], E[x x^T] of each layer's attention input
    errors = attention_errors(target, batches)           # each layer's relative output error
    distill(target, batches, steps, lr)                  # each attention trained to reproduce the source's

Distillation trains only the target's attention layers; everything else (embedding, norms, SwiGLU, head)
is the source's and stays frozen. A layer sees the source's own input for that layer, so the layers
train independently, all at once: the loss is the mean over layers of each layer's relative squared
error ||attn(x) - y||^2 / ||y||^2 on the same tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from t6.model.t6 import T6

log = logging.getLogger(__name__)


@dataclass
class LayerBatch:
    """One calibration batch as the source's layers saw it: per layer, the attention's input x (after the
    block's attention norm) and output y, [B, T, d_model] each."""

    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]

    @property
    def tokens(self) -> int:
        return self.inputs[0].shape[0] * self.inputs[0].shape[1]


@torch.no_grad()
def record_layers(source: T6, idx: torch.Tensor) -> LayerBatch:
    """Run the source on idx [B, T] and keep every layer's attention input and output."""
    inputs, outputs = [], []

    def keep(module, args, out) -> None:
        inputs.append(args[0])  # [B, T, d]
        outputs.append(out)  # [B, T, d]

    hooks = [block.attn.register_forward_hook(keep) for block in source.blocks]
    try:
        source(idx)
    finally:
        for hook in hooks:
            hook.remove()
    return LayerBatch(inputs, outputs)


def calibration_batches(source: T6, windows: list[torch.Tensor]) -> list[LayerBatch]:
    """The source's layers on each calibration batch of token windows [B, T]."""
    source.eval()
    return [record_layers(source, idx) for idx in windows]


@torch.no_grad()
def input_statistics(batches: list[LayerBatch]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (E[x] [d], E[x x^T] [d, d]) of the attention input over every calibration token, fp64."""
    n = sum(b.tokens for b in batches)
    stats = []
    for layer in range(len(batches[0].inputs)):
        xs = [b.inputs[layer].reshape(-1, b.inputs[layer].shape[-1]).double() for b in batches]  # [N_b, d] each
        mean = sum(x.sum(0) for x in xs) / n  # [d]
        second = sum(x.T @ x for x in xs) / n  # [d, d]
        stats.append((mean, second))
    return stats


def layer_outputs(target: T6, batch: LayerBatch) -> list[torch.Tensor]:
    """Each target attention on the source's input to that layer -> [B, T, d_model] per layer."""
    pos = torch.arange(batch.inputs[0].shape[1])  # [T]
    return [block.attn(x, pos) for block, x in zip(target.blocks, batch.inputs)]


def relative_errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> torch.Tensor:
    """Per layer ||got - want||^2 / ||want||^2 -> [L]."""
    return torch.stack([(g - w).pow(2).sum() / w.pow(2).sum().clamp_min(1e-30) for g, w in zip(got, want)])


@torch.no_grad()
def attention_errors(target: T6, batches: list[LayerBatch]) -> list[float]:
    """Each layer's relative attention-output error against the source, over the batches."""
    was = target.training
    target.eval()
    total = None
    for batch in batches:
        err = relative_errors(layer_outputs(target, batch), batch.outputs) * batch.tokens  # [L]
        total = err if total is None else total + err
    target.train(was)
    return (total / sum(b.tokens for b in batches)).tolist()


def distill(
    target: T6, batches: list[LayerBatch], steps: int, lr: float = 1e-3, log_every: int = 0
) -> list[tuple[int, float]]:
    """Train the target's attention layers for `steps` Adam steps (cosine-decayed lr), cycling through the
    batches, to reproduce the source's attention outputs; everything else frozen. Returns (step, mean
    relative error) of the steps logged."""
    params = [p for block in target.blocks for p in block.attn.parameters()]
    trained = {id(p) for p in params}
    frozen = [p for p in target.parameters() if id(p) not in trained]
    for p in frozen:
        p.requires_grad_(False)
    optimizer = torch.optim.Adam(params, lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(1, steps), eta_min=lr / 10)
    history = []
    target.train()
    try:
        for step in range(steps):
            batch = batches[step % len(batches)]
            loss = relative_errors(layer_outputs(target, batch), batch.outputs).mean()  # []
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            if log_every and (step % log_every == 0 or step == steps - 1):
                error = float(loss.detach())
                history.append((step, error))
                log.info("distillation step %d/%d: mean relative attention-output error %.4f", step + 1, steps, error)
    finally:
        for p in frozen:
            p.requires_grad_(True)
        target.eval()
    return history
