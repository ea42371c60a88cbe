"""Training throughput and MFU, measured once per logging interval, training's own time only."""

from __future__ import annotations

import logging
import time

import lightning as L
import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.trainer.states import TrainerFn

log = logging.getLogger(__name__)


class ThroughputMonitor(L.Callback):
    """Lightning's `Throughput` (lightning.fabric) fed the model's FLOPs as t6.model.facts measures them
    (FlopCounterMode on a meta-device copy, so nothing is allocated), logging `train/samples_per_sec`,
    `train/items_per_sec` (tokens), `train/flops_per_sec` for all ranks and `train/device/...` per device, and
    `train/device/mfu` against the device's peak for the run's compute dtype (bf16 / fp16 under mixed precision;
    TF32 for fp32 on CUDA): `peak_tflops`, which the run's plan gives when the config leaves it null
    (`t6.hardware.device.peak_flops`: Lightning's table for a GPU it knows, else a measured matmul, as on the CPU;
    `peak_source` says which), said once in the log; no MFU without it. Rank 0 measures:

    - once per `log_every_n_steps` optimizer steps (and when the run stops), not every micro-batch, so its CUDA
      synchronize costs one host-device sync per logging interval; logged at the step Lightning logs that
      step's loss at;
    - training's own time: validation and checkpoint writing (from a save's start to the next training
      batch) are left out of the interval.
    """

    def __init__(self, peak_tflops: float | None = None, peak_source: str = "callbacks.throughput.peak_tflops"):
        self.peak_tflops = peak_tflops
        self.peak_source = peak_source
        self.flops_per_batch: float | None = None  # per device and micro-batch
        self.throughput: Throughput | None = None
        self.t0 = 0.0  # when training started, moved on by the time paused
        self.samples = self.tokens = self.batches = 0
        self.pending = 0  # micro-batches since the last measurement
        self.step: int | None = None
        self.paused_at: float | None = None  # a checkpoint save's start
        self.val_start: float | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        peak = self.peak_tflops * 1e12 if self.peak_tflops else None
        if trainer.is_global_zero and peak:
            log.info("MFU against a peak of %.4g TFLOP/s: %s", peak / 1e12, self.peak_source)
        self.throughput = Throughput(available_flops=peak, world_size=trainer.world_size, window_size=2)
        if self.flops_per_batch is None:
            from t6.model.facts import flops_per_token, meta_model

            datamodule = trainer.datamodule
            seq_len, batch = datamodule.seq_len, datamodule.batch_size
            self.flops_per_batch = flops_per_token(meta_model(pl_module.model.cfg), seq_len) * seq_len * batch

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.t0, self.step = time.perf_counter(), trainer.global_step
        self.samples = self.tokens = self.batches = self.pending = 0
        self.throughput.reset()

    def on_train_batch_start(self, trainer: L.Trainer, *_) -> None:
        if self.paused_at is not None:
            self.t0 += time.perf_counter() - self.paused_at
        self.paused_at = None

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if trainer.training and self.paused_at is None:
            self.paused_at = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, *_) -> None:
        if not trainer.is_global_zero:
            return
        self.pending += 1
        self.samples += batch[0].shape[0]
        self.tokens += batch[0].numel()
        self.batches += 1
        step = trainer.global_step
        ended, self.step = step != self.step, step
        if not ended or (step % max(trainer.log_every_n_steps, 1) and not trainer.should_stop):
            return
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        self.throughput.update(
            time=time.perf_counter() - self.t0,
            batches=self.batches,
            samples=self.samples,
            lengths=self.tokens,
            flops=None if self.flops_per_batch is None else self.flops_per_batch * self.pending,
        )
        self.pending = 0
        metrics = {f"train/{k}": v for k, v in self.throughput.compute().items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step - 1)  # where Lightning logs this step's train/loss

    def on_validation_start(self, trainer: L.Trainer, *_) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self.val_start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, *_) -> None:
        if self.val_start is not None and self.paused_at is None:
            self.t0 += time.perf_counter() - self.val_start  # else the pause (a save after it) covers it
        self.val_start = None
