"""Optimizer parameter groups, the Muon + AdamW hybrid, and the warmup-cosine schedule.

Parameter groups (every optimizer gets the same three, tagged by `kind`):
  - "matrix":    2-D weights inside the blocks (attention and FFN projections), weight decay on;
  - "embedding": the token embedding (tied with the LM head), weight decay on;
  - "norm":      RMSNorm gains and any other 1-D tensor, no weight decay.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from t6.errors import SettingError

WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def plain_name(name: str) -> str:
    """A parameter's name without the prefixes FSDP, activation checkpointing and torch.compile insert."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def param_kinds(model: nn.Module) -> dict[str, str]:
    """{parameter name: kind}, decided from the names and shapes of the unwrapped model. Call it
    before FSDP shards the parameters into 1-D views, which would all look like norm gains."""
    kinds = {}
    for name, p in model.named_parameters():  # the tied LM head is the embedding: listed once
        if p.ndim < 2:
            kinds[name] = "norm"
        elif name.startswith("blocks."):
            kinds[name] = "matrix"
        else:
            kinds[name] = "embedding"
    return kinds


def param_groups(model: nn.Module, weight_decay: float, kinds: dict[str, str] | None = None) -> list[dict]:
    """The three groups over `model`'s trainable parameters. `kinds` (from `param_kinds` on the
    model before wrapping) classifies a wrapped or sharded model by its parameters' plain names."""
    kinds = param_kinds(model) if kinds is None else kinds
    groups = {"matrix": [], "embedding": [], "norm": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        kind = kinds.get(plain_name(name))
        if kind is None:
            raise KeyError(
                f"parameter {name!r} ({plain_name(name)!r}) was not classified before wrapping; "
                f"known: {sorted(kinds)[:5]}..."
            )
        groups[kind].append(p)
    return [
        {"params": params, "kind": kind, "weight_decay": 0.0 if kind == "norm" else weight_decay}
        for kind, params in groups.items()
        if params
    ]


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon (torch.optim.Muon) for the 2-D hidden matrices, AdamW for the embedding, head and norms.

    One optimizer object, so Lightning's automatic optimization, gradient clipping, LR
    schedulers and checkpoints see a single optimizer. Muon uses `adjust_lr_fn="match_rms_adamw"`
    so both halves follow the same learning rate and schedule.
    """

    def __init__(
        self,
        params: list[dict],
        lr: float,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ):
        params = [dict(g) for g in params]
        super().__init__(params, defaults={"lr": lr, "weight_decay": weight_decay})
        self.n_muon = sum(g.get("kind") == "matrix" for g in self.param_groups)
        self.param_groups.sort(key=lambda g: g.get("kind") != "matrix")  # Muon groups first
        self.muon = torch.optim.Muon(
            self.param_groups[: self.n_muon],
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            adjust_lr_fn="match_rms_adamw",
        )
        self.adamw = torch.optim.AdamW(
            self.param_groups[self.n_muon :], lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay
        )
        self._share()

    def _share(self) -> None:
        """The inner optimizers work on this optimizer's group dicts and state, so scheduling,
        state_dict and device moves act on both through the usual Optimizer attributes."""
        self.muon.param_groups = self.param_groups[: self.n_muon]
        self.adamw.param_groups = self.param_groups[self.n_muon :]
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, max_lr: float, min_lr: float
) -> dict:
    """Linear warmup from 0 to max_lr over warmup_steps, then cosine decay to min_lr at total_steps.

    Returns Lightning's scheduler dict (stepped every optimizer step). The optimizer's lr
    must be max_lr: the lambda returns the multiplier lr(step) / max_lr.
    """
    if not 0 <= min_lr <= max_lr:
        raise SettingError(f"lr_ablation: need 0 <= min_lr ({min_lr}) <= max_lr ({max_lr})")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        lr = min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * progress))
        return lr / max_lr

    return {"scheduler": LambdaLR(optimizer, factor), "interval": "step", "frequency": 1}
