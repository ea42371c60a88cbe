"""`train(cfg)`: everything `python train.py` does, as a function tests call directly: plan the run
(t6.run.plan: every decision and check, nothing built), then carry the plan out (t6.run.execute)."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from t6.run.execute import execute
from t6.run.plan import plan_run


def train(cfg: DictConfig) -> tuple[dict[str, float], dict[str, Any]]:
    """Train a T6 as configured. Returns (final metrics, the objects built: plan, model, datamodule, trainer, ...)."""
    return execute(plan_run(cfg))
