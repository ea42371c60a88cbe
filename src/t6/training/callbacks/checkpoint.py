"""Lightning's ModelCheckpoint, plus the final step saved once as last.ckpt."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint (periodic `step*.ckpt` plus `last.ckpt`) that also saves the
    final step when the periodic interval does not fall on it, once, as `last.ckpt` (the file
    `ckpt_path=last` reads). Use it with `enable_version_counter: false` so an existing
    `last.ckpt` (a resumed run's directory) is replaced, never joined by `last-v1.ckpt`.

    With `save_last: link` (last.ckpt a symlink to the newest periodic file, the paper recipes' choice)
    Lightning would link the final step's last.ckpt to the previous periodic file, an older step; the
    final step is then saved as a periodic file first, and last.ckpt links to it."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.save_last and self._last_global_step_saved != trainer.global_step and not trainer.sanity_checking:
            candidates = self._monitor_candidates(trainer)
            if self.save_last == "link" and self.save_top_k != 0 and self.monitor is None:
                self._save_topk_checkpoint(trainer, candidates)  # step{N}.ckpt of the final step, which last.ckpt links
            self._save_last_checkpoint(trainer, candidates)
        super().on_train_end(trainer, pl_module)

    @property
    def final_path(self) -> str | None:
        """The last.ckpt of this directory, when it exists."""
        if self.dirpath is None:
            return None
        path = Path(self.dirpath) / f"{self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}"
        return str(path) if path.is_file() else None
