"""Training throughput and MFU, measured once per logging interval, training's own time only."""

from __future__ import annotations

import logging
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor as LightningThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_only

from t6.training.lightning_private import logs_at_this_batch

log = logging.getLogger(__name__)


class ThroughputMonitor(LightningThroughputMonitor):
    """Lightning's ThroughputMonitor fed the model's FLOPs as t6.model.facts measures them (FlopCounterMode
    on a meta-device copy, so nothing is allocated), logging `train/samples_per_sec`,
    `train/items_per_sec` (tokens), `train/flops_per_sec` for all ranks and `train/device/...` per
    device, and `train/device/mfu` against the device's peak for the run's compute dtype (bf16 / fp16
    under mixed precision; TF32 for fp32 on CUDA): `peak_tflops`, which the run's plan fills in when the config
    leaves it null (`t6.hardware.device.peak_flops`: Lightning's table for a GPU it knows, else a measured
    matmul, as on the CPU; `peak_source` says which), said once in the log; no MFU without it. Three changes to
    Lightning's own:

    - It measures once per `log_every_n_steps` optimizer steps, not every micro-batch, so its
      CUDA synchronize costs one host-device sync per logging interval.
    - The interval excludes validation and checkpoint writing (from a save's start to the next
      training batch), so the rates are training's own.
    - The peak is the run's compute dtype's, from the precision setting (Lightning reads FSDP's gradient
      reduction dtype, which t6.training.fsdp keeps in fp32 under bf16 mixed precision).
    """

    def __init__(self, peak_tflops: float | None = None, peak_source: str = "callbacks.throughput.peak_tflops"):
        super().__init__(
            batch_size_fn=lambda batch: batch[0].shape[0], length_fn=lambda batch: batch[0].numel(), window_size=2
        )
        self.peak_tflops = peak_tflops
        self.peak_source = peak_source
        self.flops_per_batch: float | None = None
        self._pending = 0  # micro-batches since the last measurement
        self._paused_at: float | None = None
        self._val_start = 0.0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        peak = self.peak_tflops * 1e12 if self.peak_tflops else None
        if stage == "fit" and trainer.is_global_zero and peak:
            log.info("MFU against a peak of %.4g TFLOP/s: %s", peak / 1e12, self.peak_source)
        self.available_flops = peak
        for throughput in self._throughputs.values():
            throughput.available_flops = peak
        if stage == "fit" and self.flops_per_batch is None:
            from t6.model import T6
            from t6.model.facts import flops_per_token

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
        if not logs_at_this_batch(trainer):
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
