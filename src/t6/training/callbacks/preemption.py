"""The end of a run stopped by a signal (preemption, a time limit, Ctrl-C): its last.ckpt complete on every rank."""

from __future__ import annotations

import logging

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

from t6.training.callbacks.checkpoint import RunCheckpoint
from t6.training.lightning_private import last_saved_step
from t6.training.preemption import stop_signals

log = logging.getLogger(__name__)


class PreemptionCheckpoint(L.Callback):
    """When the ranks have agreed to stop (t6.training.preemption: SIGTERM, SIGINT, SIGUSR1/2 to any of them),
    `RunCheckpoint` saves `last.ckpt` at the end of that optimizer step, every rank together, and Lightning
    raises SIGTERMException on every rank; then this makes the write complete on every rank before any rank
    goes on to exit, whether the CheckpointIO writes synchronously or in a thread (Lightning's
    AsyncCheckpointIO: its teardown waits for the write and raises its error), and says where it is. A re-run
    with the same run directory (auto_resume) or `ckpt_path=last` continues from that exact step."""

    def __init__(self):
        self.saved_path: str | None = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        trainer.strategy.checkpoint_io.teardown()  # an asynchronous CheckpointIO's write ends here
        trainer.strategy.barrier("stop checkpoint written")  # no rank exits before the file is whole
        ckpt = trainer.checkpoint_callback
        saved = isinstance(ckpt, RunCheckpoint) and last_saved_step(ckpt) == trainer.global_step
        self.saved_path = ckpt.last_model_path if saved else None
        if trainer.is_global_zero:
            name = stop_signals.agreed.name if stop_signals.agreed is not None else "stop"
            if saved:
                log.warning(
                    "%s: saved %s at step %d; re-run the same command to resume",
                    name,
                    self.saved_path,
                    trainer.global_step,
                )
            else:
                log.error(
                    "%s at step %d: no checkpoint saved (callbacks.model_checkpoint is not a RunCheckpoint "
                    "with save_last: true)",
                    name,
                    trainer.global_step,
                )
