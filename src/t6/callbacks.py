"""Training callbacks for long runs: preemption checkpoints, exact RNG resume, throughput.

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
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM (SLURM preemption, `scancel`, `docker stop`, a cluster's eviction), Lightning stops
    at the next batch boundary on every rank with SIGTERMException; this saves `last.ckpt` in the
    ModelCheckpoint directory before the process exits, so a re-run with the same run directory
    (auto_resume) or `ckpt_path=last` continues from that exact step. It also writes `last.ckpt` after
    the final step when the periodic checkpoint interval does not fall on it."""

    def __init__(self, filename: str = "last.ckpt"):
        self.filename = filename
        self.saved_path: str | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        # The final optimizer step, saved in the same hook (hence the same loop state) as ModelCheckpoint's
        # periodic saves, unless that one saves this step anyway.
        ckpt = trainer.checkpoint_callback
        if ckpt is None or ckpt.dirpath is None or trainer.global_step != trainer.max_steps:
            return
        every = getattr(ckpt, "_every_n_train_steps", 0)
        if not (every and trainer.global_step % every == 0) and self.saved_path is None:
            self.saved_path = str(Path(ckpt.dirpath) / self.filename)
            trainer.save_checkpoint(self.saved_path)

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
