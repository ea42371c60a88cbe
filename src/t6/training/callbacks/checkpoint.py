"""The run's checkpoints (`RunCheckpoint`: periodic files, last.ckpt beside them, the final step), and how often a
run saves when `every_n_train_steps: auto` (`checkpoint_interval`, which the run's plan calls)."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.strategies import FSDPStrategy

from t6.errors import SettingError
from t6.training.checkpoint_io import BackgroundCheckpointIO, unique_tensors

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


class RunCheckpoint(Checkpoint):
    """The run's checkpoints, each written by `trainer.save_checkpoint` (every rank together) through the Trainer's
    CheckpointIO (t6.training.checkpoint_io: atomic, in the background from a GPU):

    - `step{N}.ckpt` (`filename`) every `every_n_train_steps` optimizer steps, at the end of the step's batch (a
      resume from it continues exactly); 0: none; None: after every validation instead. The newest `save_top_k`
      are kept (-1: all), the older ones removed once the newer is written;
    - `last.ckpt` beside the newest (`save_last: true`: a second file, through the background writer a second name
      of the periodic file, a hard link made after it is written, so the state is copied and written once; `link`: a
      relative symbolic link to the newest periodic file, made after that file is written), the file
      `ckpt_path=last` and auto_resume read;
    - at the end of training, the final step as last.ckpt when the interval did not fall on it (with `link`, as a
      periodic file that last.ckpt links to).

    `last_step` is the step last.ckpt holds; the files kept and `last_step` are in the checkpoint, so a resumed run
    goes on removing the old ones. A stop (t6.training.stop) saves last.ckpt itself unless `saves_last_at` its step."""

    def __init__(
        self,
        dirpath: str | os.PathLike,
        filename: str = "step{step:06d}",
        every_n_train_steps: int | None = 0,
        save_top_k: int = 1,
        save_last: bool | str = True,
    ):
        if save_last not in (True, False, "link"):
            raise SettingError(f"callbacks.model_checkpoint.save_last={save_last!r} must be true, false or link")
        self.dirpath, self.filename = str(dirpath), filename
        self.every_n_train_steps, self.save_top_k, self.save_last = every_n_train_steps, save_top_k, save_last
        self.kept: list[str] = []  # the periodic files of this run, oldest first
        self.last_step: int | None = None
        self.step: int | None = None  # the optimizer step the last batch ended in
        self.reserved = False  # whether the writer was asked for the staging buffers (`reserve`)

    @property
    def last_path(self) -> str:
        return str(Path(self.dirpath) / LAST)

    @property
    def final_path(self) -> str | None:
        """last.ckpt of this directory, when it exists."""
        return self.last_path if Path(self.last_path).exists() else None

    def saves_last_at(self, step: int) -> bool:
        """Whether the end of optimizer step `step` saves last.ckpt (a periodic save, with save_last)."""
        every = self.every_n_train_steps
        return bool(self.save_last and every and step % every == 0)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        step = trainer.global_step
        if step == self.step:
            return  # a micro-batch inside an optimizer step
        self.step = step
        every = self.every_n_train_steps
        if every and step % every == 0:
            self.save(trainer)
        elif every and not self.reserved:
            self.reserve(trainer, pl_module)

    def reserve(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After the first optimizer step (the optimizer's state exists): the background writer allocates the host
        buffers the periodic saves copy a GPU's state into, so the first save does not wait for them."""
        self.reserved = True
        io = trainer.strategy.checkpoint_io
        if not trainer.is_global_zero or not isinstance(io, BackgroundCheckpointIO) or io.background is False:
            return
        if isinstance(trainer.strategy, FSDPStrategy):
            return  # its full state is gathered by every rank together, into host memory: nothing to stage
        state = [pl_module.state_dict(), *(opt.state_dict()["state"] for opt in trainer.optimizers)]
        on_device = [t for t in unique_tensors(state) if t.device.type != "cpu"]
        if on_device:
            io.reserve(on_device)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.every_n_train_steps is None and not trainer.sanity_checking and self.last_step != trainer.global_step:
            self.save(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.save_last and self.last_step != trainer.global_step:
            self.save(trainer, periodic=self.save_last == "link")  # a link needs a file to name

    def save(self, trainer: L.Trainer, periodic: bool = True) -> None:
        step = trainer.global_step
        path = str(Path(self.dirpath) / f"{self.filename.format(step=step)}.ckpt")
        periodic = periodic and self.save_top_k != 0
        if periodic:
            trainer.save_checkpoint(path, weights_only=False)  # the whole state: a resume needs it
            self.kept = [p for p in self.kept if p != path] + [path]
        if self.save_last == "link" and periodic:
            self.link(trainer, path)
        elif self.save_last and periodic and isinstance(trainer.strategy.checkpoint_io, BackgroundCheckpointIO):
            self.second_name(trainer, path)
        elif self.save_last:
            trainer.save_checkpoint(self.last_path, weights_only=False)
        if self.save_last:
            self.last_step = step
        keep = len(self.kept) if self.save_top_k < 0 else self.save_top_k
        for old in self.kept[: len(self.kept) - keep]:
            trainer.strategy.remove_checkpoint(old)  # after the newer file is written (in the writer's order)
        self.kept = self.kept[len(self.kept) - keep :]

    def link(self, trainer: L.Trainer, path: str) -> None:
        """last.ckpt becomes a link to path, after path is written (by the background writer when there is one)."""
        io = trainer.strategy.checkpoint_io
        if trainer.is_global_zero:
            if isinstance(io, BackgroundCheckpointIO):
                io.submit(replace_link, path, self.last_path)
            else:
                replace_link(path, self.last_path)
        trainer.strategy.barrier("last.ckpt linked")

    def second_name(self, trainer: L.Trainer, path: str) -> None:
        """last.ckpt becomes a second name of the file just saved (a hard link; a copy where the file system has
        none), after it is written: one copy of the state off the GPU and one write per save instead of two."""
        if trainer.is_global_zero:
            trainer.strategy.checkpoint_io.submit(replace_hard_link, path, self.last_path)
        trainer.strategy.barrier("last.ckpt named")

    def state_dict(self) -> dict:
        return {"kept": list(self.kept), "last_step": self.last_step}

    def load_state_dict(self, state_dict: dict) -> None:
        self.kept = [p for p in state_dict.get("kept", []) if Path(p).parent == Path(self.dirpath)]
        self.last_step = state_dict.get("last_step")


LAST = "last.ckpt"


def replace_hard_link(filepath: str, linkpath: str) -> None:
    """linkpath becomes a second name of filepath's file (renamed over the old one): a hard link, or a copy written
    to disk where the file system has no hard links. Checkpoints are never changed in place (each write is a new
    file renamed over the old), so the two names stay equal until one is replaced."""
    tmp = f"{linkpath}.{os.getpid()}.link"
    try:
        os.link(filepath, tmp)
    except OSError:
        shutil.copyfile(filepath, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    os.replace(tmp, linkpath)


def replace_link(filepath: str, linkpath: str) -> None:
    """linkpath becomes a relative symbolic link to filepath: a new link renamed over the old one."""
    tmp = f"{linkpath}.{os.getpid()}.link"
    os.symlink(os.path.relpath(filepath, os.path.dirname(linkpath)), tmp)
    os.replace(tmp, linkpath)
