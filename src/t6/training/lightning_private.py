"""Where t6 reaches into Lightning past its public API, in one place. Each function names what it relies on;
tests/test_library_internals.py checks every private member here (and those t6's subclasses override) against
the pinned Lightning, and the tests named beside each function pin the behaviour. An upgrade that changes one
fails there, not silently in a run.

Subclasses of Lightning's classes (RunCheckpoint, ThroughputMonitor, StepProgressBar, T6FSDPStrategy,
OutboxMLFlowLogger) use their base class's protected members in their own code; those are listed in the test's
table too.
"""

from __future__ import annotations

import lightning as L
from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device, _setup_activation_checkpointing
from lightning.fabric.strategies.model_parallel import _load_raw_module_state
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

# Lightning's signal connector: registers its SIGTERM/SIGUSR handlers and holds `received_sigterm`, the flag its
# loops check at each step's end (t6.training.preemption.AgreedStopConnector replaces its handlers).
SignalConnector = _SignalConnector

# FSDP's helpers (t6.training.fsdp): torchmetrics onto the device, activation checkpointing per block, a full
# state dict loaded into a wrapped module.
move_torchmetrics_to_device = _move_torchmetrics_to_device
setup_activation_checkpointing = _setup_activation_checkpointing
load_raw_module_state = _load_raw_module_state


def use_signal_connector(trainer: L.Trainer, connector: _SignalConnector) -> None:
    """The Trainer's signal handling becomes `connector`'s, and the training loop's broadcast of rank 0's stop
    flag before every batch (a collective and a host read each) is switched off: the connector's flag is set
    on every rank at once (tests/test_preemption.py, tests/test_faults.py)."""
    trainer._signal_connector = connector
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None


def stop_at_this_step(trainer: L.Trainer) -> None:
    """Lightning raises SIGTERMException at the end of the current step, skipping a validation due there
    (tests/test_resume.py: the stop's checkpoint is at that step and a resume continues exactly)."""
    trainer._signal_connector.received_sigterm = True
    trainer.fit_loop.epoch_loop._skip_next_val = True


def logs_at_this_batch(trainer: L.Trainer) -> bool:
    """Whether this micro-batch ends an optimizer step on which the Trainer logs (every `log_every_n_steps`):
    the throughput callback measures there only (tests/test_train.py)."""
    return not trainer.fit_loop._should_accumulate() and trainer._logger_connector.should_update_logs


def last_saved_step(checkpoint: ModelCheckpoint) -> int:
    """The optimizer step of the newest checkpoint `checkpoint` wrote (tests/test_resume.py)."""
    return checkpoint._last_global_step_saved


def tracking_uri(logger: MLFlowLogger) -> str:
    """The tracking URI an MLFlowLogger writes to, as it was given (no public accessor)."""
    return logger._tracking_uri
