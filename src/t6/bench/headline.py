"""The headline run, shrunk: `python train.py attention=tpa size=medium` as a new user runs it (compile=auto, the
embedded corpus, the closing samples), cut to a few dozen steps, one periodic checkpoint and an evaluation on a
few hundred items, with what it costs measured.

    python -m t6.bench.headline --json headline.json                 # medium (a GPU)
    python -m t6.bench.headline --size tiny --steps 6 --eval-limit 8  # the suite's --smoke, on a CPU

The run is `t6.run.train.main` itself, with a CSV logger instead of MLflow (the record reads the metrics the run
logs) and one callback of this module, `StepTimes`. The record: the first step and its compile
(`perf/first_step_s`, `perf/compile_s`), tokens/s and MFU (the median of `train/device/items_per_sec` and
`train/device/mfu`), the stall of the step after the periodic checkpoint against the median step, the
evaluation's time (`perf/eval_s`), the closing samples' time (`perf/samples_s`) and all the time after training
(the final checkpoint, validation, evaluation and samples), training's share of the wall time from the fit's
start to the run's end, and the accelerators that fell back (t6.model.fallback).
"""

from __future__ import annotations

import csv
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from omegaconf import open_dict

from t6.bench import harness
from t6.bench.common import compose
from t6.model import fallback


class StepTimes(L.Callback):
    """The wall time at the fit's start, at the end of each optimizer step (the device synchronized) and at the
    training's end."""

    def __init__(self):
        self.fit_start = self.train_end = None
        self.ends: list[tuple[int, float]] = []  # (global step, time) at each optimizer step's end

    def on_fit_start(self, trainer, pl_module) -> None:
        self.fit_start = time.perf_counter()

    def on_train_batch_start(self, trainer, *_) -> None:
        if not self.ends:
            self.ends.append((trainer.global_step, time.perf_counter()))  # the first step starts

    def on_train_batch_end(self, trainer, *_) -> None:
        if trainer.global_step == self.ends[-1][0]:
            return  # a micro-batch that did not end an optimizer step
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        self.ends.append((trainer.global_step, time.perf_counter()))

    def on_train_end(self, trainer, pl_module) -> None:
        self.train_end = time.perf_counter()

    def durations(self) -> dict[int, float]:
        """Seconds of each optimizer step, by the step it reached."""
        return {step: end - begin for (_, begin), (step, end) in zip(self.ends, self.ends[1:])}


def overrides(size: str, steps: int, eval_limit: int, samples_tokens: int, compile_: str = "auto") -> list[str]:
    checkpoint_at = max(1, steps // 2)
    return [
        "attention=tpa",
        f"size={size}",
        f"compile={compile_}",
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={steps}",
        "trainer.log_every_n_steps=1",
        f"callbacks.model_checkpoint.every_n_train_steps={checkpoint_at}",
        "data.val_windows=16",
        "eval=local",
        f"eval.limit={eval_limit}",
        "eval.num_fewshot=[0]",
        f"samples.max_new_tokens={samples_tokens}",
        "logger=none",
        "auto_resume=false",
        "print_config=false",
    ]


def metrics_of(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The CSV logger's metrics: name -> [(step, value)]."""
    out: dict[str, list[tuple[int, float]]] = {}
    with open(log_dir / "metrics.csv") as f:
        for row in csv.DictReader(f):
            for name, value in row.items():
                if name != "step" and value not in ("", None):
                    out.setdefault(name, []).append((int(row["step"]), float(value)))
    return out


def measure(size: str, steps: int, eval_limit: int, samples_tokens: int, root: Path, compile_: str = "auto") -> dict:
    from t6.evaluation.callback import DownstreamEval
    from t6.run.train import main as train

    cfg = compose("train", overrides(size, steps, eval_limit, samples_tokens, compile_), runtime=True)
    with open_dict(cfg):
        cfg.paths.output_dir = str(root / "run")
        cfg.paths.compile_cache_dir = str(root / "compile-cache")  # cold: a new user's first run on this machine
        cfg.logger = {"csv": {"_target_": "lightning.pytorch.loggers.CSVLogger", "save_dir": str(root), "name": "csv"}}
        cfg.callbacks.step_times = {"_target_": f"{__name__}.StepTimes"}
    metrics, objects = train(cfg)
    end = time.perf_counter()
    trainer, plan = objects["trainer"], objects["plan"]
    times = next(cb for cb in trainer.callbacks if isinstance(cb, StepTimes))
    evaluation = next((cb for cb in trainer.callbacks if isinstance(cb, DownstreamEval)), None)
    logged = metrics_of(Path(trainer.loggers[0].log_dir))
    durations = times.durations()
    checkpoint_at = cfg.callbacks.model_checkpoint.every_n_train_steps
    steady = [s for step, s in durations.items() if step not in (1, checkpoint_at + 1)]  # not the compile's
    median_step = statistics.median(steady) if steady else None
    after_checkpoint = durations.get(checkpoint_at + 1)
    stall = None if after_checkpoint is None or median_step is None else after_checkpoint - median_step
    cache = plan.hardware.compile_cache
    last = lambda name: logged[name][-1][1] if name in logged else None  # noqa: E731
    median = lambda name: statistics.median(v for _, v in logged[name]) if name in logged else None  # noqa: E731
    wall = end - times.fit_start
    record = {
        "attention": plan.model.attention,
        "size": size,
        "device": plan.hardware.device,
        "precision": plan.hardware.precision,
        "compile": plan.hardware.compile,
        "steps": steps,
        "micro_batch": plan.batch.micro_batch,
        "seq_len": plan.batch.seq_len,
        "first_step_s": last("perf/first_step_s"),
        "compile_s": last("perf/compile_s"),
        "compile_cache": None if cache is None else ("warm" if cache.warm else "cold"),
        "step_s": median_step,
        "tokens_per_s": median("train/device/items_per_sec"),
        "mfu": median("train/device/mfu"),
        "checkpoint_stall_s": stall,
        "checkpoint_stall_ratio": None if stall is None else stall / median_step,  # over the median step
        "checkpoint_background": plan.checkpoints.background if plan.checkpoints else None,
        "eval_s": evaluation.seconds[-1] if evaluation and evaluation.seconds else None,
        "eval_items": 2 * eval_limit,
        "samples_s": last("perf/samples_s"),
        "closing_s": end - times.train_end,  # the final checkpoint, validation, evaluation and samples
        "wall_s": wall,
        "training_share": sum(durations.values()) / wall,
        "val_loss": metrics.get("val/loss"),
        "fallbacks": ", ".join(e.name for e in fallback.events()) or "none",
    }
    if plan.hardware.compile:
        record.update(warm_compile(size, root, compile_))
    return record


def warm_compile(size: str, root: Path, compile_: str) -> dict:
    """The run again with the same shapes, a few steps, nothing else (no evaluation, samples or checkpoint), dynamo
    reset as in a new process: its compile loads what the first run left in the compile cache folder. Returns
    `compile_warm_s` (its perf/compile_s) and `warm_cache_hits` (graphs loaded)."""
    from t6.run.train import main as train

    steps = 4  # the compile's share: the first step minus the median of the next three
    cfg = compose("train", overrides(size, steps, 1, 1, compile_), runtime=True)
    with open_dict(cfg):
        cfg.paths.output_dir = str(root / "warm")
        cfg.paths.compile_cache_dir = str(root / "compile-cache")
        cfg.logger = {"csv": {"_target_": "lightning.pytorch.loggers.CSVLogger", "save_dir": str(root), "name": "warm"}}
        cfg.eval, cfg.samples, cfg.callbacks.model_checkpoint = None, None, None
        cfg.trainer.val_check_interval = None
        cfg.trainer.limit_val_batches = 0
    torch._dynamo.reset()
    _, objects = train(cfg)
    logged = metrics_of(Path(objects["trainer"].loggers[0].log_dir))
    value = lambda name: logged[name][-1][1] if name in logged else None  # noqa: E731
    return {"compile_warm_s": value("perf/compile_s"), "warm_cache_hits": value("perf/compile_cache_hits")}


COLUMNS = [
    ("device", "device", ""),
    ("compile", "compile", ""),
    ("first_step_s", "first step s", ".1f"),
    ("compile_s", "compile s", ".1f"),
    ("compile_cache", "cache", ""),
    ("compile_warm_s", "compile s, warm", ".1f"),
    ("step_s", "step s", ".3f"),
    ("tokens_per_s", "tokens/s", ",.0f"),
    ("mfu", "MFU", ".1%"),
    ("checkpoint_stall_s", "checkpoint stall s", ".2f"),
    ("checkpoint_stall_ratio", "stall / step", ".0%"),
    ("eval_s", "eval s", ".1f"),
    ("samples_s", "samples s", ".1f"),
    ("closing_s", "after training s", ".1f"),
    ("training_share", "training share", ".0%"),
    ("fallbacks", "fell back", ""),
]


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    parser.add_argument("--size", default="medium")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (a checkpoint at half of them)")
    parser.add_argument("--eval-limit", type=int, default=150, help="items per local task (two tasks, zero-shot)")
    parser.add_argument("--samples-tokens", type=int, default=40, help="tokens of each closing greedy sample")
    parser.add_argument("--compile", default="auto", help="the run's compile setting (auto: on for CUDA)")
    parser.add_argument("--json", type=Path, default=None, help="write the record to this JSON file")
    args = harness.parse(parser, argv)
    with tempfile.TemporaryDirectory(prefix="t6-headline-") as root:
        record = measure(args.size, args.steps, args.eval_limit, args.samples_tokens, Path(root), args.compile)
    result = harness.result("headline", record["device"], [record])
    harness.finish(result, COLUMNS, args.json)
    return result


if __name__ == "__main__":
    main()
