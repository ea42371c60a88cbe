"""How long the first training step took, where torch.compile compiles the blocks' training graph."""

from __future__ import annotations

import logging
import statistics
import time

import lightning as L
import torch

from t6.errors import SettingError
from t6.hardware.compile_cache import cache_counts

log = logging.getLogger(__name__)


class CompileTime(L.Callback):
    """Times the first `1 + steps` optimizer steps of a fit (the device synchronized at each step's end)
    and logs, once, `perf/first_step_s` (the first step's wall time) and `perf/compile_s` (that minus the
    median of the steps after it: the compile's share, near 0 when nothing compiles), beside the plan's
    expectation (RunPlan.describe). The first validation compiles a graph of its own (no gradients),
    not counted here. Where the steps compiled, also `perf/compile_cache_hits` and `perf/compile_cache_misses`:
    the graphs loaded from torch.compile's cache folder (t6.hardware.compile_cache) and those compiled anew."""

    def __init__(self, steps: int = 3):
        if steps < 1:
            raise SettingError(f"callbacks.compile_time.steps={steps} must be at least 1")
        self.steps = steps
        self.start: float | None = None
        self.ends: list[float] = []
        self.last_step: int | None = None
        self.logged = False
        self.counts_before: dict[str, int] | None = None

    def on_train_batch_start(self, trainer: L.Trainer, *_) -> None:
        if self.start is None:
            self.start, self.last_step = time.perf_counter(), trainer.global_step
            self.counts_before = cache_counts()

    def on_train_batch_end(self, trainer: L.Trainer, *_) -> None:
        if self.logged or trainer.global_step == self.last_step:
            return  # done, or a micro-batch that did not end an optimizer step
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        self.ends.append(time.perf_counter())
        self.last_step = trainer.global_step
        if len(self.ends) > self.steps:
            self.report(trainer)

    def on_train_end(self, trainer: L.Trainer, *_) -> None:
        if not self.logged and self.ends:
            self.report(trainer)  # a run shorter than the steps timed

    def report(self, trainer: L.Trainer) -> None:
        self.logged = True
        times = [end - begin for begin, end in zip([self.start, *self.ends], self.ends)]  # seconds per step
        first, later = times[0], times[1:]
        metrics = {"perf/first_step_s": first}
        if later:
            metrics["perf/compile_s"] = max(0.0, first - statistics.median(later))
        counts = {k: v - self.counts_before.get(k, 0) for k, v in cache_counts().items()}
        if counts["aot_hits"] or counts["aot_misses"]:  # the steps compiled: what the cache held of it
            metrics["perf/compile_cache_hits"] = counts["aot_hits"]
            metrics["perf/compile_cache_misses"] = counts["aot_misses"]
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        cache = ""
        if "perf/compile_cache_hits" in metrics:
            cache = f" (compile cache: {counts['aot_hits']} graphs loaded, {counts['aot_misses']} compiled)"
        if later:
            log.info(
                "first training step: %.1f s; compiling ~%.1f s%s, a step after it %.3g s",
                first,
                metrics["perf/compile_s"],
                cache,
                statistics.median(later),
            )
        else:
            log.info("first training step: %.1f s", first)
