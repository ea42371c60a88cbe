"""Lightning's ModelCheckpoint, plus the final step, and the step where the ranks agreed to stop, saved once
as last.ckpt; and how often a run saves when `every_n_train_steps: auto` (`checkpoint_interval`, which the
run's plan calls)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from t6.training.checkpoint_io import BackgroundCheckpointIO

# What the automatic interval assumes (every_n_train_steps=auto):
FAILURE_INTERVAL_S = 24 * 3600.0  # mean time between failures that lose unsaved work (SIGTERM saves on its own)
HOST_COPY_BYTES_S = 5e9  # a GPU's training state copied into host memory: what a background save blocks for
WRITE_BYTES_S = 0.5e9  # torch.save + fsync to a local disk: a synchronous save blocks for it (medium: 4.2 GB, ~8 s)


def checkpoint_interval(state_bytes: int, step_s: float, background: bool, max_steps: int) -> tuple[int, str]:
    """(every_n_train_steps, why) for a checkpoint of state_bytes (weights and optimizer state) and an
    optimizer step of about step_s seconds: Young's interval (1974), the training time between saves that
    loses the least to saving plus redoing the work lost at a failure, sqrt(2 x seconds a save blocks x
    mean time between failures), and no shorter than a background save's writing (saves never queue);
    rounded down to 1, 2 or 5 x 10^k steps. 0 when that is the whole run or longer: no periodic saves,
    `last.ckpt` at the end (and on SIGTERM) only."""
    blocking = state_bytes / (HOST_COPY_BYTES_S if background else WRITE_BYTES_S)
    young = math.sqrt(2 * blocking * FAILURE_INTERVAL_S)
    seconds = max(young, state_bytes / WRITE_BYTES_S)
    steps = seconds / step_s
    how = (
        f"Young's interval sqrt(2 x {blocking:.2g} s blocked per save of {state_bytes / 2**30:.2f} GiB x "
        f"{FAILURE_INTERVAL_S / 3600:g} h between failures) = {seconds:.0f} s = {steps:.0f} steps of ~{step_s:.2g} s"
    )
    if steps >= max_steps:
        return 0, f"auto: only last.ckpt, at the end: {how}, more than the run's {max_steps}"
    every = max(1, nice_floor(steps))
    return every, f"auto: {how}, rounded down"


def nice_floor(x: float) -> int:
    """The largest of 1, 2, 5 x 10^k not above x (x >= 1)."""
    power = 10 ** math.floor(math.log10(x))
    return int(max(m for m in (1, 2, 5) if m * power <= x) * power)


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint (periodic `step*.ckpt` plus `last.ckpt`) that also saves, once, as
    `last.ckpt` (the file `ckpt_path=last` reads) when the periodic interval does not fall on it: the final
    step, and the step at which the ranks agreed to stop (t6.training.preemption; Lightning raises
    SIGTERMException at that step's end). The stop is saved here, at the end of the step's batch, as a periodic
    checkpoint is: a resume from it continues exactly as from one (a save later in the step, after its
    validation, would make Lightning's resume count the step twice). Use it with `enable_version_counter:
    false` so an existing `last.ckpt` (a resumed run's directory) is replaced, never joined by `last-v1.ckpt`.

    With `save_last: link` (last.ckpt a symlink to the newest periodic file, the paper recipes' choice)
    Lightning would link the final step's last.ckpt to the previous periodic file, an older step; the
    final step is then saved as a periodic file first, and last.ckpt links to it."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args, **kwargs) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        if trainer.received_sigterm and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))  # every rank: a collective

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.save_last and self._last_global_step_saved != trainer.global_step and not trainer.sanity_checking:
            candidates = self._monitor_candidates(trainer)
            if self.save_last == "link" and self.save_top_k != 0 and self.monitor is None:
                self._save_topk_checkpoint(trainer, candidates)  # step{N}.ckpt of the final step, which last.ckpt links
            self._save_last_checkpoint(trainer, candidates)
        super().on_train_end(trainer, pl_module)

    @staticmethod
    def _link_checkpoint(trainer: L.Trainer, filepath: str, linkpath: str) -> None:
        """`save_last: link`: with checkpoints written in the background, the link is made by the writer
        after the file it names is written, and replaces the old link atomically, so `last.ckpt` never
        names a file being written."""
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, BackgroundCheckpointIO):
            return ModelCheckpoint._link_checkpoint(trainer, filepath, linkpath)
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            io.submit(replace_link, filepath, linkpath)
        trainer.strategy.barrier()

    @property
    def final_path(self) -> str | None:
        """The last.ckpt of this directory, when it exists."""
        if self.dirpath is None:
            return None
        path = Path(self.dirpath) / f"{self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}"
        return str(path) if path.is_file() else None


def replace_link(filepath: str, linkpath: str) -> None:
    """linkpath becomes a relative symbolic link to filepath: a new link renamed over the old one."""
    tmp = f"{linkpath}.{os.getpid()}.link"
    os.symlink(os.path.relpath(filepath, os.path.dirname(linkpath)), tmp)
    os.replace(tmp, linkpath)
