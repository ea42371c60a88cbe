"""Every run ends with a validation of its final weights."""

from __future__ import annotations

import lightning as L


class FinalValidation(L.Callback):
    """Every run ends with a validation: when the last optimizer step is not one that
    `trainer.val_check_interval` validates, asking the Trainer to stop after it makes Lightning
    run the validation loop there (as it does for early stopping), so `val/loss` of the final
    weights reaches the loggers and the closing summary."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
            trainer.should_stop = True
