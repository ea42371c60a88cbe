"""The LightningModule: next-token cross-entropy over the T6 backbone."""

from __future__ import annotations

from typing import Callable

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import MLFlowLogger
from torchmetrics import MeanMetric

from t6.model import T6, ModelConfig
from t6.optim import param_groups


class T6LitModule(L.LightningModule):
    def __init__(
        self,
        model_config: dict,
        optimizer: Callable | None = None,
        scheduler: Callable | None = None,
        compile: bool = False,
        run_config: dict | None = None,
    ):
        """model_config: ModelConfig fields as a plain dict (checkpoints stay loadable with
        weights_only=True); optimizer / scheduler: partials from Hydra, bound in configure_optimizers;
        run_config: the resolved experiment config, stored in checkpoints for eval/generate."""
        super().__init__()
        self.save_hyperparameters("model_config", "compile", logger=False)
        self.model = T6(ModelConfig(**model_config))
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.run_config = run_config
        self.val_loss = MeanMetric()
        self.forward_fn = torch.compile(self.model) if compile else self.model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.forward_fn(idx)  # [B, T, vocab]

    def loss(self, batch) -> torch.Tensor:
        x, y = batch  # [B, T], [B, T]
        logits = self(x)  # [B, T, vocab]
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch[0].shape[0])
        self.log("lr", self.optimizers().param_groups[0]["lr"], batch_size=batch[0].shape[0])
        return loss

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
