"""A resumable last.ckpt when the run is stopped by SIGTERM (preemption) or Ctrl-C."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM (SLURM preemption, `scancel`, `docker stop`, a cluster's eviction), Lightning stops
    at the next batch boundary on every rank with SIGTERMException; this saves `last.ckpt` in the
    ModelCheckpoint directory before the process exits, so a re-run with the same run directory
    (auto_resume) or `ckpt_path=last` continues from that exact step. (The final step of a run that ends
    normally is saved by `RunCheckpoint`.)

    Ctrl-C (SIGINT) takes the same path: the first one asks Lightning to stop at the next batch
    boundary (its SIGTERM flag), so the interrupted run is saved and resumable; a second Ctrl-C
    interrupts at once, without saving. `signum` is the signal that stopped the run."""

    def __init__(self, filename: str = "last.ckpt"):
        self.filename = filename
        self.saved_path: str | None = None
        self.signum: int = signal.SIGTERM

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning's teardown restores the handlers it found at fit start, this one included.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, lambda signum, frame: self._on_sigint(trainer))

    def _on_sigint(self, trainer: L.Trainer) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C: KeyboardInterrupt now
        self.signum = signal.SIGINT
        trainer._signal_connector.received_sigterm = True  # the flag Lightning's loops check at batch boundaries
        if trainer.is_global_zero:
            sys.stderr.write(
                "\nCtrl-C: stopping after this step to save last.ckpt (press Ctrl-C again to quit without saving)\n"
            )

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.checkpoint_callback is None:
            return
        dirpath = trainer.checkpoint_callback.dirpath
        if dirpath is None:
            return
        path = str(Path(dirpath) / self.filename)
        trainer.save_checkpoint(
            path, weights_only=False
        )  # resumable; every rank calls it (a collective), rank 0 writes
        self.saved_path = path
        if trainer.is_global_zero:
            log.warning(
                "%s: saved %s at step %d; re-run the same command to resume",
                signal.Signals(self.signum).name,
                path,
                trainer.global_step,
            )
