"""How a run stops on a signal: every rank at the same optimizer step, last.ckpt saved there, the signal handed back.

A scheduler stops a job by signalling some or all of its processes, not at the same moment: SLURM signals every
task of every node (SIGTERM on preemption or at the time limit, SIGUSR1/SIGUSR2 ahead of it with `--signal`),
submitit asks for USR2, torchrun's agent forwards SIGTERM, a terminal sends SIGINT to the foreground group. Acting
on a signal inside its handler, or on each rank's own flag, leaves ranks in different collectives (a hang). So the
path is one piece, `StopProtocol` (a callback every run has), in four steps, in the order they run:

1. Signal. While the fit runs, SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 only record a request (`StopSignals`).
   Lightning's own SIGTERM handling is off: its handler broadcasts inside the handler, and each rank would stop
   on its own flag.
2. Agreement. At the end of every optimizer step the ranks all-reduce their requests (MAX): one all_reduce and
   one host read per step, only where several processes run, none per micro-batch. A module that reads a flag of
   its own at that point (T6LitModule's non-finite gradient check) calls `any_rank(trainer, flag)`, which carries
   the request in the same all_reduce, so the step still has one host sync; where no module does (one that
   overrides the check, or optimizes manually), the protocol all-reduces on its own. Every rank gets the same
   answer at the same step.
3. Save. At that step every rank saves last.ckpt together (`trainer.save_checkpoint`), at the end of the step's
   batch as a periodic checkpoint is saved, so a resume continues exactly as from one.
4. Exit. The save also ends the fit's loop as early stopping does (`trainer.should_stop`); at the first hook after
   the step (the validation Lightning then starts, skipped: a preempted job has seconds; or the epoch's end) every
   rank waits until the checkpoint is on disk (a background writer included) and raises `RunStopped`.
   `python train.py` then marks the MLflow run KILLED and calls `hand_over(signum)`: the signal goes to whoever
   owned it before the run (submitit's handler requeues on USR2; Lightning's SLURM auto-requeue signal, SIGUSR1
   by default, runs `scontrol requeue`), and the process exits 128 + signum (143 for SIGTERM, 130 for Ctrl-C).

A second Ctrl-C quits at once, without saving. A stop agreed at the run's last step lets the run end as it would.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import FrameType

import lightning as L
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only

from t6.training.callbacks.checkpoint import RunCheckpoint

log = logging.getLogger(__name__)

# A stop request travels as a code (0: none); when ranks got different signals the agreement (MAX) keeps the
# one latest in this order: a requeue signal over SIGTERM over Ctrl-C.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def code_of(signum: int) -> int:
    return STOP_SIGNALS.index(signum) + 1


def signal_of(code: int) -> signal.Signals:
    return STOP_SIGNALS[code - 1]


# ------------------------------------------------------------------------------------------------ 1. signal


class StopSignals:
    """Handlers for STOP_SIGNALS that only record the request (`requested`, a code). `install()` sets them (from
    the main thread) and `restore()` puts back the handlers it found."""

    def __init__(self):
        self.requested = 0  # this process's request, a code (0: none)
        self.previous: dict[int, object] = {}

    def install(self) -> None:
        self.requested = 0
        if threading.current_thread() is threading.main_thread() and not self.previous:
            for signum in STOP_SIGNALS:
                self.previous[signum] = signal.signal(signum, self.handle)

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.requested == code_of(signal.SIGINT):
            raise KeyboardInterrupt  # the second Ctrl-C: quit now, without saving
        if signum == signal.SIGINT and rank_zero_only.rank == 0:
            sys.stderr.write(
                "\nCtrl-C: stopping after this step to save last.ckpt (press Ctrl-C again to quit without saving)\n"
            )
        self.requested = max(self.requested, code_of(signum))


class LightningSignalsOff:
    """Stands in for the Trainer's signal connector: registers no handler and never sets `received_sigterm`, the
    flag Lightning's loops would raise on (each rank on its own)."""

    received_sigterm = False

    def register_signal_handlers(self) -> None:
        pass

    def teardown(self) -> None:
        pass


def lightning_signals_off(trainer: L.Trainer) -> None:
    """Lightning 2.6 has no public switch for either: its SIGTERM handler (which broadcasts rank 0's flag inside the
    handler), and its broadcast of rank 0's flag before every micro-batch (a collective and a host read each)."""
    trainer._signal_connector = LightningSignalsOff()
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None


# ------------------------------------------------------------------------------------------------ 2. agreement


def all_reduce_max(trainer: L.Trainer, flags: torch.Tensor) -> None:
    """flags all-reduced with MAX in place, where several processes run."""
    if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)


def any_rank(trainer: L.Trainer, flag: torch.Tensor) -> bool:
    """Whether `flag` (a 0-dim tensor; nonzero: set) is set on any rank, read at the end of an optimizer step in the
    same all_reduce and host read as the stop request (step 2 of the module docstring)."""
    protocol = StopProtocol.of(trainer)
    request = protocol.signals.requested if protocol is not None else 0
    flags = torch.stack([flag.float(), torch.full((), float(request), device=flag.device)])  # [2]; a fill: no copy
    all_reduce_max(trainer, flags)
    flagged, code = (int(v) for v in flags.tolist())  # the step's host sync
    if protocol is not None:
        protocol.answer = code
    return bool(flagged)


# ------------------------------------------------------------------------------------------------ 4. exit


class RunStopped(SystemExit):
    """Raised on every rank at the step the ranks agreed to stop at, after last.ckpt is on disk; `signum` is the
    agreed signal, `cluster_environment` the Trainer's (for `hand_over`)."""

    def __init__(self, signum: int, step: int, path: str, cluster_environment=None):
        super().__init__(128 + signum)
        self.signum, self.step, self.path = signum, step, path
        self.cluster_environment = cluster_environment


class StopProtocol(L.Callback):
    """Steps 1-4 of the module docstring as one callback; `path` is the last.ckpt the stop saves (unless the run's
    RunCheckpoint saves it at that step anyway, after this callback's hook)."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self.signals = StopSignals()
        self.answer: int | None = None  # this step's request, when a module's check carried it (`any_rank`)
        self.step: int | None = None  # the optimizer step the last batch ended in
        self.agreed: signal.Signals | None = None

    @staticmethod
    def of(trainer: L.Trainer) -> StopProtocol | None:
        return next((cb for cb in trainer.callbacks if isinstance(cb, StopProtocol)), None)

    # 1. signal: recorded from the fit's setup to its end
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.agreed = None
            lightning_signals_off(trainer)
            self.signals.install()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.signals.restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, (RunStopped, KeyboardInterrupt)):
            self.signals.restore()  # hand_over finds the handlers the run found; a second Ctrl-C quits
        # Any other failure: the signals stay recorded until the run has said where it stopped (`t6.run.execute`
        # restores them then). When one rank dies, torchrun's agent SIGTERMs the others at once, and the default
        # handler would end a rank in the middle of its failure note.

    # 2. agreement, and 3. save, at the end of every optimizer step
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if trainer.global_step == self.step:
            return  # a micro-batch inside an optimizer step: nothing is read
        self.step = trainer.global_step
        code = self.answer if self.answer is not None else self.agree(trainer)
        self.answer = None
        last_step = 0 <= trainer.max_steps <= trainer.global_step
        if code and self.agreed is None and not last_step:
            self.agreed = signal_of(code)
            self.save(trainer)

    def agree(self, trainer: L.Trainer) -> int:
        """The stop request of any rank (MAX), where no module's check carried it this step."""
        if trainer.world_size == 1:
            return self.signals.requested
        request = torch.full((), self.signals.requested, device=trainer.strategy.root_device)
        all_reduce_max(trainer, request)
        return int(request.item())

    def save(self, trainer: L.Trainer) -> None:
        periodic = trainer.checkpoint_callback
        if not (isinstance(periodic, RunCheckpoint) and periodic.saves_last_at(trainer.global_step)):
            trainer.save_checkpoint(self.path, weights_only=False)  # every rank: a collective (FSDP's gather)
        trainer.should_stop = True  # the loop ends after this step, as for early stopping

    # 4. exit: at the first hook after the stop's step
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.exit(trainer)  # the validation should_stop asks for: skipped

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.exit(trainer)  # no validation data

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        self.exit(trainer)  # the loop went on (trainer.min_steps not reached)

    def exit(self, trainer: L.Trainer) -> None:
        if self.agreed is None:
            return
        trainer.strategy.checkpoint_io.teardown()  # a background writer finishes (and raises its error) here
        trainer.strategy.barrier("stop checkpoint written")  # no rank leaves before the file is whole
        if trainer.is_global_zero:
            log.warning("%s: saved %s at step %d", self.agreed.name, self.path, trainer.global_step)
        environment = getattr(trainer.strategy, "cluster_environment", None)
        raise RunStopped(self.agreed, trainer.global_step, self.path, environment)


def hand_over(signum: int, cluster_environment=None) -> None:
    """After the checkpoint is saved: the signal's previous owner acts on it (submitit requeues on USR2, and exits
    itself), or Lightning's SLURM auto-requeue signal requeues the job; then exit 128 + signum. The stop signals
    are ignored from here on (torchrun's agent, seeing another rank exit first, signals the rest)."""
    handler = signal.getsignal(signum)
    for other in STOP_SIGNALS:  # on the way out with 128 + signum: a launcher's later SIGTERM changes nothing
        signal.signal(other, signal.SIG_IGN)
    if callable(handler) and handler is not signal.default_int_handler:
        handler(signum, None)
    elif slurm_requeues(signum, cluster_environment):
        requeue_slurm_job()
    sys.exit(128 + signum)


def slurm_requeues(signum: int, environment) -> bool:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return (
        isinstance(environment, SLURMEnvironment)
        and environment.auto_requeue
        and environment.requeue_signal == signum
        and environment.global_rank() == 0
    )


def requeue_slurm_job() -> None:
    """`scontrol requeue` this SLURM job (an array task by its array id), as Lightning's auto-requeue does."""
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array_job}_{array_task}" if array_job and array_task else os.environ["SLURM_JOB_ID"]
    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if result.returncode == 0:
        log.warning("requeued SLURM job %s; it resumes from last.ckpt", job)
    else:
        log.error("scontrol requeue %s failed (%d): %s", job, result.returncode, result.stderr.strip())
