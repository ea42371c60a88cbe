"""The LightningModule: next-token cross-entropy over the T6 backbone."""

from __future__ import annotations

import logging
from typing import Callable

import lightning as L
import torch
from lightning.pytorch.loggers import MLFlowLogger
from torchmetrics import MeanMetric

from t6.model import T6, ModelConfig
from t6.optim import param_groups

log = logging.getLogger(__name__)


class T6LitModule(L.LightningModule):
    def __init__(
        self,
        model_config: dict,
        optimizer: Callable | None = None,
        scheduler: Callable | None = None,
        compile: bool = False,
        run_config: dict | None = None,
        nonfinite_loss: str = "stop",
        loss_chunk_tokens: int | None = 1024,
    ):
        """model_config: ModelConfig fields as a plain dict (checkpoints stay loadable with
        weights_only=True); optimizer / scheduler: partials from Hydra, bound in configure_optimizers;
        run_config: the resolved experiment config, stored in checkpoints for eval/generate;
        nonfinite_loss: "stop" (raise, keeping the last good checkpoint) or "skip" (drop that batch
        on every rank: no backward, no optimizer update) when a training loss is NaN or inf;
        loss_chunk_tokens: tokens per chunk of the LM head + cross-entropy (None: all logits at once)."""
        super().__init__()
        if nonfinite_loss not in ("stop", "skip"):
            raise ValueError(f"nonfinite_loss={nonfinite_loss!r} must be 'stop' or 'skip'")
        self.nonfinite_loss = nonfinite_loss
        self.loss_chunk_tokens = loss_chunk_tokens
        self.skipped_batches = 0
        self.save_hyperparameters("model_config", "compile", logger=False)
        self.model = T6(ModelConfig(**model_config))
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.run_config = run_config
        self.val_loss = MeanMetric()
        if compile:
            self.model.compile()  # in place: checkpoints keep the plain `model.` parameter names

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)  # [B, T, vocab]

    def loss(self, batch) -> torch.Tensor:
        x, y = batch  # [B, T], [B, T]
        return self.model(x, targets=y, loss_chunk_tokens=self.loss_chunk_tokens)  # [] mean over B*T tokens

    def training_step(self, batch, batch_idx: int) -> torch.Tensor | None:
        loss = self.loss(batch)
        if not self.trainer.strategy.reduce_boolean_decision(bool(torch.isfinite(loss)), all=True):
            return self.on_nonfinite_loss(loss)  # decided on all ranks together, so DDP never waits on one
        self.log("train/loss", loss, prog_bar=True, batch_size=batch[0].shape[0])
        self.log("lr", self.optimizers().param_groups[0]["lr"], batch_size=batch[0].shape[0])
        return loss

    def on_nonfinite_loss(self, loss: torch.Tensor) -> None:
        ckpt = self.trainer.checkpoint_callback
        last_good = (ckpt.last_model_path or None) if ckpt is not None else None
        message = f"non-finite training loss ({loss.item()} on rank {self.global_rank}, or another rank) at step {self.global_step}"
        if self.nonfinite_loss == "stop":
            raise FloatingPointError(
                f"{message}; stopping. "
                + (f"The last good checkpoint is kept: {last_good}. " if last_good else "No checkpoint was saved yet. ")
                + "Lower the learning rate, "
                "or set nonfinite_loss=skip to drop such batches"
            )
        self.skipped_batches += 1
        self.log("train/skipped_batches", float(self.skipped_batches), on_step=True, on_epoch=False)
        if self.global_rank == 0:
            log.warning("%s; skipping the batch (%d so far)", message, self.skipped_batches)
        return None

    def validation_step(self, batch, batch_idx: int) -> None:
        self.val_loss.update(self.loss(batch), weight=batch[0].shape[0])

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log_dict({"val/loss": loss, "val/ppl": torch.exp(loss)}, prog_bar=True, sync_dist=False)

    def configure_optimizers(self):
        if self.optimizer_factory is None:
            raise ValueError("no optimizer configured: set the `optimizer` config group")
        decay = getattr(self.optimizer_factory, "keywords", {}).get("weight_decay", 0.0)
        optimizer = self.optimizer_factory(param_groups(self.model, decay))
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler_factory(optimizer)}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.run_config is not None:
            checkpoint["run_config"] = self.run_config
        for logger in self.loggers:
            if isinstance(logger, MLFlowLogger):
                checkpoint["mlflow_run_id"] = logger.run_id  # a resumed run continues this MLflow run
