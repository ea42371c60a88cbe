"""The accelerators that fell back to their eager path during a run (t6.model.fallback), recorded in the run."""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
from lightning.pytorch.loggers import MLFlowLogger

from t6.model import fallback


class FallbackLog(L.Callback):
    """Logs each accelerator that failed and fell back (t6.model.fallback) to the run's loggers: the metric
    `fallback/<name>` = 1 at the step it happened and, in MLflow, the tag `fallback/<name>` with the warning.
    A run starts with every accelerator untried (a sweep's earlier job may have turned one off in this process:
    this run tries it again, and records its own failure). It listens until the next run's FallbackLog starts,
    so a fallback of the closing samples, after fit, is recorded as well."""

    stop_listening: Callable[[], None] | None = None  # the listening FallbackLog's, one per process

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if FallbackLog.stop_listening is not None:
            FallbackLog.stop_listening()
        self.trainer = trainer
        fallback.reset()
        FallbackLog.stop_listening = fallback.subscribe(self.record)

    def record(self, event: fallback.Event) -> None:
        trainer = self.trainer
        for logger in trainer.loggers:
            logger.log_metrics({f"fallback/{event.name}": 1.0}, step=trainer.global_step)
            if isinstance(logger, MLFlowLogger) and trainer.is_global_zero:
                logger.experiment.set_tag(logger.run_id, f"fallback/{event.name}", event.message())
