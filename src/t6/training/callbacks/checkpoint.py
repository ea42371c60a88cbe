"""Lightning's ModelCheckpoint, plus the final step, and the step where the ranks agreed to stop, saved once as
last.ckpt."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint (periodic `step*.ckpt` plus `last.ckpt`) that also saves, once, as
    `last.ckpt` (the file `ckpt_path=last` reads) when the periodic interval does not fall on it: the final
    step, and the step at which the ranks agreed to stop (t6.training.preemption; Lightning raises
    SIGTERMException at that step's end). The stop is saved here, at the end of the step's batch, as a periodic
    checkpoint is: a resume from it continues exactly as from one (a save later in the step, after its
    validation, would make Lightning's resume count the step twice). Use it with `save_last: true` and
    `enable_version_counter: false` so an existing `last.ckpt` (a resumed run's directory) is replaced, never
    joined by `last-v1.ckpt`."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args, **kwargs) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        if trainer.received_sigterm and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))  # every rank: a collective

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.save_last and self._last_global_step_saved != trainer.global_step and not trainer.sanity_checking:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        super().on_train_end(trainer, pl_module)

    @property
    def final_path(self) -> str | None:
        """The last.ckpt of this directory, when it exists."""
        if self.dirpath is None:
            return None
        path = Path(self.dirpath) / f"{self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}"
        return str(path) if path.is_file() else None
