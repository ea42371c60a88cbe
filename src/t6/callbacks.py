"""Training callbacks for long runs: the final validation and checkpoint, preemption checkpoints,
exact RNG resume, throughput and MFU, and the ranks' agreement on the micro-batch.

All but the last are listed in conf/callbacks/default.yaml (train.py adds `SameMicroBatch` with the
memory plan); each does one thing.
"""

from __future__ import annotations

import logging
import random
import signal
import sys
import threading
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.callbacks import ThroughputMonitor as LightningThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)


class SameMicroBatch(L.Callback):
    """Each rank planned its micro-batch from its own device's free memory before the processes met
    (t6.memory, data.batch_size=auto); data-parallel ranks must run the same one, or their collectives
    stop pairing up and training hangs without a word. At setup, where the process group exists, the
    ranks compare plans: different ones are an error on every rank, before the first step, naming the
    micro-batch that fits them all."""

    def __init__(self, batch: int, available: int):
        self.batch, self.available = batch, available

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.world_size == 1:
            return
        mine = torch.tensor([self.batch, self.available // 2**20], device=trainer.strategy.root_device)
        plans = trainer.strategy.all_gather(mine).reshape(-1, 2).tolist()  # [world, (micro-batch, MiB free)]
        if len({batch for batch, _ in plans}) > 1:
            each = ", ".join(f"rank {r}: {b} ({mib / 1024:.1f} GiB free)" for r, (b, mib) in enumerate(plans))
            fits = min(b for b, _ in plans)
            raise MemoryError(
                f"data.batch_size=auto planned different micro-batches on different devices ({each}); "
                f"data-parallel ranks must agree: set data.batch_size={fits}, which fits every device"
            )


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


class ThroughputMonitor(LightningThroughputMonitor):
    """Lightning's ThroughputMonitor fed the model's FLOPs as t6.perf measures them (FlopCounterMode
    on a meta-device copy, so nothing is allocated), logging `train/samples_per_sec`,
    `train/items_per_sec` (tokens), `train/flops_per_sec` for all ranks and `train/device/...` per
    device, and `train/device/mfu` against the device's peak: `peak_tflops` when given, else
    Lightning's table for the run's compute dtype (bf16 / fp16 under mixed precision; TF32 for fp32
    on CUDA). Three changes to Lightning's own:

    - It measures once per `log_every_n_steps` optimizer steps, not every micro-batch, so its
      CUDA synchronize costs one host-device sync per logging interval.
    - The interval excludes validation and checkpoint writing (from a save's start to the next
      training batch), so the rates are training's own.
    - The compute dtype comes from the precision setting (Lightning reads FSDP's gradient
      reduction dtype, which t6.fsdp keeps in fp32 under bf16 mixed precision).
    """

    def __init__(self, peak_tflops: float | None = None):
        super().__init__(
            batch_size_fn=lambda batch: batch[0].shape[0], length_fn=lambda batch: batch[0].numel(), window_size=2
        )
        self.peak_tflops = peak_tflops
        self.flops_per_batch: float | None = None
        self._pending = 0  # micro-batches since the last measurement
        self._paused_at: float | None = None
        self._val_start = 0.0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        precision = str(trainer.precision)
        dtype = torch.bfloat16 if "bf16" in precision else torch.float16 if "16" in precision else torch.float32
        peak = self.peak_tflops * 1e12 if self.peak_tflops else get_available_flops(trainer.strategy.root_device, dtype)
        self.available_flops = peak
        for throughput in self._throughputs.values():
            throughput.available_flops = peak
        if stage == "fit" and self.flops_per_batch is None:
            from t6.model import T6
            from t6.perf import flops_per_token

            with torch.device("meta"):
                meta = T6(pl_module.model.cfg)
            datamodule = trainer.datamodule
            seq_len, batch = datamodule.seq_len, datamodule.batch_size
            self.flops_per_batch = flops_per_token(meta, seq_len) * seq_len * batch  # per device and micro-batch

    def on_train_batch_start(self, trainer: L.Trainer, *_) -> None:
        if self._paused_at is not None and trainer.is_global_zero:
            self._t0s[RunningStage.TRAINING] += time.perf_counter() - self._paused_at
        self._paused_at = None

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if trainer.state.stage == RunningStage.TRAINING and self._paused_at is None:
            self._paused_at = time.perf_counter()

    @rank_zero_only
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, *_) -> None:
        self._pending += 1
        stage = trainer.state.stage
        self._samples[stage] += self.batch_size_fn(batch)
        self._lengths[stage] += self.length_fn(batch)
        self._batches[stage] += 1
        if trainer.fit_loop._should_accumulate() or not trainer._logger_connector.should_update_logs:
            return
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        self._throughputs[stage].update(
            time=time.perf_counter() - self._t0s[stage],
            batches=self._batches[stage],
            samples=self._samples[stage],
            lengths=self._lengths[stage],
            flops=None if self.flops_per_batch is None else self.flops_per_batch * self._pending,
        )
        self._pending = 0
        self._compute(trainer)

    @rank_zero_only
    def on_validation_start(self, trainer: L.Trainer, *_) -> None:
        if not trainer.sanity_checking:
            self._val_start = time.perf_counter()

    @rank_zero_only
    def on_validation_batch_end(self, *_, **__) -> None:
        pass  # training throughput only; validation's is not a figure of merit

    @rank_zero_only
    def on_validation_end(self, trainer: L.Trainer, *_) -> None:
        if not trainer.sanity_checking and trainer.state.fn == TrainerFn.FITTING and self._paused_at is None:
            self._t0s[RunningStage.TRAINING] += time.perf_counter() - self._val_start  # else the pause covers it
