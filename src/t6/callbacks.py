"""Training callbacks for long runs: the final validation and checkpoint, preemption checkpoints, exact
RNG resume, grad norm, throughput.

All of them are listed in conf/callbacks/default.yaml; each does one thing.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM (SLURM preemption, `scancel`, `docker stop`, a cluster's eviction), Lightning stops
    at the next batch boundary on every rank with SIGTERMException; this saves `last.ckpt` in the
    ModelCheckpoint directory before the process exits, so a re-run with the same run directory
    (auto_resume) or `ckpt_path=last` continues from that exact step. (The final step of a run that
    ends normally is saved by `RunCheckpoint`.)"""

    def __init__(self, filename: str = "last.ckpt"):
        self.filename = filename
        self.saved_path: str | None = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.checkpoint_callback is None:
            return
        dirpath = trainer.checkpoint_callback.dirpath
        if dirpath is None:
            return
        path = str(Path(dirpath) / self.filename)
        trainer.save_checkpoint(path)  # every rank calls it (a collective under DDP/FSDP); rank 0 writes
        self.saved_path = path
        if trainer.is_global_zero:
            log.warning("SIGTERM: saved %s at step %d; re-run the same command to resume", path, trainer.global_step)


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint (periodic `step*.ckpt` plus `last.ckpt`) that also saves the
    final step when the periodic interval does not fall on it, once, as `last.ckpt` (the file
    `ckpt_path=last` reads). Use it with `enable_version_counter: false` so an existing
    `last.ckpt` (a resumed run's directory) is replaced, never joined by `last-v1.ckpt`."""

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


class FinalValidation(L.Callback):
    """Every run ends with a validation: when the last optimizer step is not one that
    `trainer.val_check_interval` validates, asking the Trainer to stop after it makes Lightning
    run the validation loop there (as it does for early stopping), so `val/loss` of the final
    weights reaches the loggers and the closing summary."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
            trainer.should_stop = True


def _rng_state() -> dict:
    """This process's RNG states as tensors and plain Python values (loadable with weights_only=True)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "python": [version, list(py_state), py_gauss],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, py_state, py_gauss = state["python"]
    random.setstate((version, tuple(py_state), py_gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RNGState(L.Callback):
    """Saves every rank's torch / CUDA / NumPy / Python RNG state in the checkpoint and restores the
    rank's own state on resume, right before the first training batch (so nothing Lightning draws
    while setting up moves it), so dropout-like randomness continues as if never interrupted."""

    def __init__(self):
        self._pending: dict | None = None

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        state = _rng_state()
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            states: list = [None] * trainer.world_size
            torch.distributed.all_gather_object(states, state)  # every rank saves together
        else:
            states = [state]
        checkpoint["rng_states"] = states

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        states = checkpoint.get("rng_states")
        if not states:
            return
        if len(states) != trainer.world_size:
            log.warning("checkpoint has RNG states of %d ranks, this run has %d; not restoring them", len(states), trainer.world_size)
            return
        self._pending = states[trainer.global_rank]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if self._pending is not None:
            _set_rng_state(self._pending)
            self._pending = None


class GradNormMonitor(L.Callback):
    """Logs `train/grad_norm`: the global L2 norm of the gradients before clipping."""

    def __init__(self, every_n_steps: int | None = None):
        self.every_n_steps = every_n_steps

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        every = self.every_n_steps or trainer.log_every_n_steps
        if trainer.global_step % every:
            return
        norms = [p.grad.detach().float().norm() for p in pl_module.parameters() if p.grad is not None]
        if norms:
            pl_module.log("train/grad_norm", torch.linalg.vector_norm(torch.stack(norms)), on_step=True, on_epoch=False)


class ThroughputLogger(L.Callback):
    """Logs `perf/tokens_per_s` (all ranks together), `perf/step_time_s` and `perf/samples_per_s`,
    averaged over the optimizer steps since the last log."""

    def __init__(self, every_n_steps: int | None = None):
        self.every_n_steps = every_n_steps
        self._t0: float | None = None
        self._step0 = 0
        self._tokens = 0
        self._samples = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t0, self._step0, self._tokens, self._samples = time.perf_counter(), trainer.global_step, 0, 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        x = batch[0]  # [B, T] on this rank
        self._tokens += x.numel() * trainer.world_size
        self._samples += x.shape[0] * trainer.world_size
        every = self.every_n_steps or trainer.log_every_n_steps
        steps = trainer.global_step - self._step0
        if steps < every or self._t0 is None:
            return
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        dt = time.perf_counter() - self._t0
        pl_module.log_dict(
            {"perf/tokens_per_s": self._tokens / dt, "perf/samples_per_s": self._samples / dt, "perf/step_time_s": dt / steps},
            on_step=True, on_epoch=False,
        )
        self._t0, self._step0, self._tokens, self._samples = time.perf_counter(), trainer.global_step, 0, 0
