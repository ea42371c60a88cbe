"""What a sweep (`python train.py -m ...`) says about its jobs: `SweepReport`, a Hydra callback
(conf/hydra/default.yaml).

1. Before any job starts, a sweep that cannot mean what it says is refused once (exit 2): `optimizer.lr=A,B` under a
   learning-rate schedule, whose peak is lr_ablation.max_lr (every job would be refused on its own).
2. Each job that fails is said as it fails, on the console, with its overrides and its error, and recorded in
   `<sweep dir>/jobs.jsonl` (one line per job's end, from whichever process ran it: joblib's, SLURM's).
3. At the sweep's end, however it ends (Hydra stops with the first failed job's error, after every job of the batch
   ran), the summary: how many jobs finished and failed, and each failed job's overrides and error.

The MLflow side of a sweep (a parent run, a child run per job, FAILED with its error) is t6.tracking.sweep's.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from t6.errors import SettingError, UserError, UserExit
from t6.hardware.probes import env_rank
from t6.tracking.sweep import swept_keys

log = logging.getLogger(__name__)
JOBS = "jobs.jsonl"


class SweepReport(Callback):
    def __init__(self):
        self.sweep_dir: Path | None = None  # set in the process that launches the sweep

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if env_rank() != 0:
            return
        swept = swept_keys(list(config.hydra.overrides.task), config.hydra.sweeper.get("params"))
        if "optimizer.lr" in swept and config.lr_ablation.get("scheduler"):
            raise UserExit(
                SettingError(
                    "optimizer.lr is swept, but under a learning-rate schedule the peak is lr_ablation.max_lr (the "
                    "schedule scales the optimizer's lr to it): sweep lr_ablation.max_lr=A,B instead (with "
                    "lr_ablation.min_lr where it should follow)"
                )
            )
        self.sweep_dir = Path(config.hydra.sweep.dir)
        atexit.register(self.summarize)  # also when Hydra leaves with the first failed job's error

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus
        from hydra.types import RunMode

        if env_rank() != 0 or config.hydra.mode != RunMode.MULTIRUN:  # a single run is no sweep's job
            return
        job, overrides = int(config.hydra.job.num), job_overrides(config)
        record = {"job": job, "overrides": overrides, "status": "finished"}
        if job_return.status == JobStatus.FAILED:
            try:
                job_return.return_value  # raises the job's error
            except BaseException as err:  # whatever the job raised
                record.update(status="failed", error=error_line(err))
            log.error("sweep job %d (%s) failed: %s", job, overrides, record["error"])
        with open(Path(config.hydra.sweep.dir) / JOBS, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")  # one write of one line: whole, whichever process writes beside it

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self.summarize()

    def summarize(self) -> None:
        """The sweep's end in a few lines on stderr (once)."""
        if self.sweep_dir is None:
            return
        text = summary(self.sweep_dir)
        self.sweep_dir = None
        if text:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()


def job_overrides(config: DictConfig) -> str:
    """What this job of the sweep varies (`data.seq_len=128 seed=2`): its overrides of the keys the sweep sweeps,
    read from the sweep's own config (multirun.yaml, which Hydra writes into the sweep directory); all of them
    where there is none."""
    from omegaconf import OmegaConf

    overrides = list(config.hydra.overrides.task)
    path = Path(config.hydra.sweep.dir) / "multirun.yaml"
    if not path.is_file():
        return " ".join(overrides)
    sweep = OmegaConf.load(path).hydra
    keys = swept_keys(list(sweep.overrides.task), sweep.sweeper.get("params"))
    return " ".join(o for o in overrides if o.partition("=")[0].lstrip("+~") in keys)


def error_line(err: BaseException) -> str:
    """A job's error on one line: a user's mistake (t6.errors.UserError) in its own words, anything else with its
    type's name."""
    text = " ".join(line.strip(" -") for line in str(err).splitlines() if line.strip(" -"))
    return (text if isinstance(err, UserError) else f"{type(err).__name__}: {text}")[:1000]


def summary(sweep_dir: str | Path) -> str:
    """`sweep DIR: N jobs: a finished, b failed` and a line for each failed job (its overrides and error), from the
    jobs' records (the last of each job: a rerun of the sweep replaces the earlier); "" when none ended."""
    path = Path(sweep_dir) / JOBS
    if not path.is_file():
        return ""
    last = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        last[record["job"]] = record
    failed = [r for _, r in sorted(last.items()) if r["status"] == "failed"]
    lines = [f"sweep {sweep_dir}: {len(last)} jobs: {len(last) - len(failed)} finished, {len(failed)} failed"]
    lines += [f"  job {r['job']} ({r['overrides']}): {r['error']}" for r in failed]
    return os.linesep.join(lines)
