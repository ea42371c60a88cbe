"""One stop protocol for every launcher (torchrun, SLURM, submitit, Lightning's own DDP launcher, a terminal).

A scheduler stops a job by signalling some or all of its processes, not at the same moment: SLURM signals every
task of every node (SIGTERM on preemption or at the time limit, SIGUSR1/SIGUSR2 ahead of it with `--signal`),
submitit asks for USR2, a terminal sends SIGINT to the foreground group. Acting on a signal inside its
handler, or on each rank's own flag, leaves ranks in different collectives (a hang). Here:

1. `StopSignals` (installed for the whole run by `t6.run.execute`): a handler only records the signal.
2. Once per optimizer step the ranks agree on it with one all_reduce(MAX), folded into the gradient
   norm's non-finite check (`T6LitModule.configure_gradient_clipping`): `agree_on_step_end`. Every rank
   sees the same answer at the same step, so every rank stops there.
3. Lightning then raises SIGTERMException on every rank at that step's end (its flag is
   `trainer.received_sigterm`, set only by the agreement: `AgreedStopConnector`), and
   `t6.training.callbacks.RunCheckpoint` saves last.ckpt there, every rank together, as a periodic checkpoint
   (`PreemptionCheckpoint` sees the write complete on every rank before any exits). A validation due at
   that step is skipped: a preempted job has seconds (and Lightning would stop it at its first batch).
4. After the save (and the MLflow run marked KILLED), `hand_over(signum)` gives the signal to whoever
   owned it before the run: submitit's handler requeues the job (USR2), Lightning's SLURM auto-requeue
   signal (SIGUSR1 by default) runs `scontrol requeue`; then the process exits 128 + signum (143 for
   SIGTERM, 130 for Ctrl-C), what schedulers and shells expect.

A second Ctrl-C quits at once, without saving.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from types import FrameType

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only

from t6.training.lightning_private import SignalConnector, stop_at_this_step, use_signal_connector

log = logging.getLogger(__name__)

# A stop request travels as a code (0: none); when ranks got different signals the agreement (MAX) keeps the
# one latest in this order: a requeue signal over SIGTERM over Ctrl-C.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def code_of(signum: int) -> int:
    return STOP_SIGNALS.index(signum) + 1


def signal_of(code: int) -> signal.Signals:
    return STOP_SIGNALS[code - 1]


class StopSignals:
    """Handlers for STOP_SIGNALS that only record the request (`requested`, a code); as a context manager it
    installs them and restores the previous handlers on exit. One per process (`stop_signals`)."""

    def __init__(self):
        self.requested = 0  # this process's request, a code (0: none)
        self.agreed: signal.Signals | None = None  # the stop every rank agreed on
        self.previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        self.requested, self.agreed = 0, None
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self.previous[signum] = signal.signal(signum, self.handle)
        return self

    def __exit__(self, *exc) -> None:
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

    def agree(self, code: int) -> None:
        """Every rank's `agree_on_step_end` found this code: the run stops at this step."""
        self.agreed = signal_of(code)


stop_signals = StopSignals()


def agree_on_step_end(trainer, norm: torch.Tensor) -> bool:
    """The one host read of an optimizer step: whether the gradient norm is finite on every rank, and whether
    any rank was asked to stop, in one all_reduce(MAX) (only where several processes run). A stop agreed here
    sets Lightning's flag on every rank at the same step. Returns whether the norm is finite."""
    request = torch.full((), float(stop_signals.requested), device=norm.device)  # a fill kernel: no copy from the host
    flags = torch.stack([torch.isfinite(norm).logical_not().float(), request])  # [2]
    if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)  # [2] on every rank
    nonfinite, stop = (int(v) for v in flags.tolist())  # the host sync
    if stop and stop_signals.agreed is None:
        stop_signals.agree(stop)
        stop_at_this_step(trainer)  # no validation at the stop's step: the checkpoint first
    return not nonfinite


class AgreedStopConnector(SignalConnector):
    """Lightning's signal connector without its handlers: Lightning's SIGTERM handler broadcasts inside the
    handler and each rank raises on its own flag (ranks stop at different steps and hang in each other's
    collectives). `received_sigterm` is set only by `agree_on_step_end`; the handlers are `StopSignals`'."""

    def register_signal_handlers(self) -> None:
        self.received_sigterm = stop_signals.agreed is not None

    def teardown(self) -> None:
        pass


def install(trainer) -> None:
    """Make `trainer` stop only where its ranks agreed. Lightning's per-batch broadcast of rank 0's flag (a
    collective and a host read every micro-batch) carries nothing once every rank holds the agreed flag."""
    use_signal_connector(trainer, AgreedStopConnector(trainer))


def hand_over(signum: int, cluster_environment=None) -> None:
    """After the checkpoint is saved: the signal's previous owner acts on it (submitit requeues on USR2, and
    exits itself), or Lightning's SLURM auto-requeue signal requeues the job; then exit 128 + signum. The stop
    signals are ignored from here on (torchrun's agent, seeing another rank exit first, signals the rest)."""
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
