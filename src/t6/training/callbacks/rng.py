"""Every rank's RNG states in the checkpoint, restored on resume."""

from __future__ import annotations

import logging
import random

import lightning as L
import numpy as np
import torch

log = logging.getLogger(__name__)


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
            log.warning(
                "checkpoint has RNG states of %d ranks, this run has %d; not restoring them",
                len(states),
                trainer.world_size,
            )
            return
        self._pending = states[trainer.global_rank]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if self._pending is not None:
            _set_rng_state(self._pending)
            self._pending = None
