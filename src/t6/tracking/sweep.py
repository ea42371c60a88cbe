"""Hydra sweeps as MLflow parent and child runs.

`MLflowSweepCallback` (a Hydra callback, conf/hydra/default.yaml) runs in the process that
launches the sweep, before any job starts: it creates the sweep's experiment and a parent run
and writes them to `<sweep dir>/mlflow_sweep.json`. Every job of the sweep (in-process,
joblib, submitit/SLURM) finds that file through its own Hydra config and logs as a child run
of the parent, tagged with its overrides, so MLflow's compare view lines the jobs up.
Creating the experiment once, up front, is what keeps parallel jobs from racing to create it.

Every job is accounted for: when one ends (in its own process), a failed job's child run is FAILED with its
error (a child run is made for a job that failed before it made one), and the parent run counts its children's
ends (tags `jobs.finished`, `jobs.failed`, ...), FAILED as soon as one job failed (Hydra stops a sweep with a
failed job before its end); at the sweep's end it is FINISHED when every job finished.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from t6.errors import DamagedFile, MissingFile

log = logging.getLogger(__name__)
SWEEP_FILE = "mlflow_sweep.json"


def swept_keys(overrides: list[str], sweeper_params: dict | None = None) -> list[str]:
    """The keys a sweep varies (`attention=mha,tpa`, `range(...)`, `choice(...)`), by Hydra's own parser:
    on the command line, and in `hydra.sweeper.params` (where a recipe declares its sweep)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    declared = [f"{key}={value}" for key, value in (sweeper_params or {}).items()]
    keys = [
        o.key_or_group for o in OverridesParser.create().parse_overrides(declared + overrides) if o.is_sweep_override()
    ]
    return list(dict.fromkeys(keys))


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


class MLflowSweepCallback(Callback):
    def __init__(
        self,
        experiment_name: str | None = None,
        logger: str | None = None,
        tracking_uri: str | None = None,
        artifact_dir: str | None = None,
    ):
        """experiment_name: the experiment of the sweep; default `<experiment_name>-sweep-<sweep dir name>`.
        logger, tracking_uri, artifact_dir: the run's MLflow logger (its `_target_`; None: no MLflow logger, no
        parent run), its store and the artifacts' place, as conf/hydra/default.yaml passes them from logger.mlflow."""
        self.experiment_name, self.logger = experiment_name, logger
        self.tracking_uri, self.artifact_dir = tracking_uri, artifact_dir

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from t6.hardware.probes import env_rank
        from t6.tracking.mlflow import (
            EXPERIMENT_KIND_TAG,
            TRAINING_KIND,
            artifact_location,
            check_tracking_uri,
            tag_training_experiment,
        )

        if self.logger is None or env_rank() != 0:
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        path = sweep_dir / SWEEP_FILE
        uri = self.tracking_uri
        check_tracking_uri(uri)
        client = _client(uri)
        if path.is_file():  # the same sweep started again (fixed hydra.sweep.dir, after preemption): reuse it
            info = json.loads(path.read_text())
            client.update_run(info["parent_run_id"], status="RUNNING")
            return
        name = self.experiment_name or f"{config.experiment_name}-sweep-{sweep_dir.name}"
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            artifacts = artifact_location(uri, self.artifact_dir)
            experiment_id = client.create_experiment(
                name, artifact_location=artifacts, tags={EXPERIMENT_KIND_TAG: TRAINING_KIND}
            )
        else:
            experiment_id = experiment.experiment_id
            tag_training_experiment(client, experiment_id)
        overrides = " ".join(config.hydra.overrides.task)
        parent = client.create_run(
            experiment_id,
            run_name=f"sweep {sweep_dir.name}",
            tags={"sweep.dir": str(sweep_dir), "sweep.overrides": overrides},
        )
        info = {
            "tracking_uri": uri,
            "experiment_name": name,
            "experiment_id": experiment_id,
            "parent_run_id": parent.info.run_id,
            "swept_keys": swept_keys(list(config.hydra.overrides.task), config.hydra.sweeper.get("params")),
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(info, indent=2))
        tmp.replace(path)
        log.info("MLflow sweep: experiment %r, parent run %s", name, parent.info.run_id)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        from t6.hardware.probes import env_rank

        info = sweep_job_info()
        if info is None or env_rank() != 0:
            return
        client = _client(info["tracking_uri"])
        try:
            if job_return.status == JobStatus.FAILED:
                try:
                    job_return.return_value  # raises the job's error
                except BaseException as err:  # whatever the job raised
                    record_failed_job(client, info, f"{type(err).__name__}: {err}")
            account(client, info, final=False)
        except Exception as err:  # the store away: the jobs' own runs say what they can
            log.warning("MLflow sweep: could not account for job %s (%s)", info["job_num"], err)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from t6.hardware.probes import env_rank

        path = Path(config.hydra.sweep.dir) / SWEEP_FILE
        if env_rank() == 0 and path.is_file():
            info = read_sweep_file(config.hydra.sweep.dir)
            account(_client(info["tracking_uri"]), info, final=True)


def children(client, info: dict) -> list:
    """The sweep's child runs (one per job that made one)."""
    experiment = client.get_run(info["parent_run_id"]).info.experiment_id
    query = f"tags.`mlflow.parentRunId` = '{info['parent_run_id']}'"
    return client.search_runs([experiment], filter_string=query, max_results=10000)


def record_failed_job(client, info: dict, error: str) -> None:
    """The job's child run FAILED with its error; made now when the job failed before making one."""
    job = str(info["job_num"])
    run = next((r for r in children(client, info) if r.data.tags.get("sweep.job") == job), None)
    if run is None:
        experiment = client.get_run(info["parent_run_id"]).info.experiment_id
        _, name, tags = sweep_job_run(info)
        run = client.create_run(experiment, run_name=name, tags=tags)
    client.set_tag(run.info.run_id, "error", error[:5000])
    client.set_terminated(run.info.run_id, "FAILED")


def account(client, info: dict, final: bool) -> None:
    """The parent run's count of its children's ends (`jobs.<status>` tags); FAILED once a job failed, FINISHED at
    the sweep's end when none did."""
    statuses = [r.info.status for r in children(client, info)]
    counts = {status: statuses.count(status) for status in ("FINISHED", "FAILED", "KILLED", "RUNNING")}
    parent = info["parent_run_id"]
    for status, count in counts.items():
        client.set_tag(parent, f"jobs.{status.lower()}", str(count))
    if counts["FAILED"]:
        client.set_terminated(parent, "FAILED")
    elif final:
        client.set_terminated(parent, "FINISHED")


def read_sweep_file(sweep_dir: str | Path) -> dict:
    """The MLflow store, experiment and parent run a sweep directory (hydra.sweep.dir) recorded."""
    path = Path(sweep_dir) / SWEEP_FILE
    if not path.is_file():
        raise MissingFile(
            f"{path} does not exist: {sweep_dir} is not the directory of a sweep "
            f"(python train.py -m ... with logger=mlflow writes it at the start)"
        )
    try:
        info = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise DamagedFile(f"{path} is not the JSON a sweep writes ({err}); give the sweep's own directory") from None
    missing = [key for key in ("tracking_uri", "parent_run_id") if not isinstance(info, dict) or key not in info]
    if missing:
        raise DamagedFile(
            f"{path} lacks {', '.join(missing)}: not a file a sweep wrote; give the sweep's own directory"
        )
    return info


def sweep_job_info() -> dict | None:
    """For a job of a multirun: the sweep's MLflow experiment and parent run, plus this job's overrides."""
    from hydra.core.hydra_config import HydraConfig

    from t6.hydra_config import in_multirun

    if not in_multirun():
        return None
    hydra_cfg = HydraConfig.get()
    path = Path(hydra_cfg.sweep.dir) / SWEEP_FILE
    if not path.is_file():
        return None
    info = json.loads(path.read_text())
    info["overrides"] = list(hydra_cfg.overrides.task)
    info["job_num"] = int(hydra_cfg.job.num)
    return info


def sweep_job_run(info: dict) -> tuple[str, str, dict[str, str]]:
    """This job's MLflow run in the sweep: (the sweep's experiment, the run's name: what the job varies, its tags:
    a child of the parent run, the job's number and overrides)."""
    swept = [o for o in info["overrides"] if o.partition("=")[0].lstrip("+~") in info["swept_keys"]]  # what varies
    tags = {
        "mlflow.parentRunId": info["parent_run_id"],
        "sweep.job": str(info["job_num"]),
        "sweep.params": " ".join(swept),
        "sweep.overrides": " ".join(info["overrides"]),
    }
    for override in info["overrides"]:
        key, _, value = override.partition("=")
        tags[f"override.{key.lstrip('+~')}"] = value
    return info["experiment_name"], " ".join(swept) or f"job {info['job_num']}", tags
