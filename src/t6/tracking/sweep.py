"""Hydra sweeps as MLflow parent and child runs.

`MLflowSweepCallback` (a Hydra callback, conf/hydra/default.yaml) runs in the process that
launches the sweep, before any job starts: it creates the sweep's experiment and a parent run
and writes them to `<sweep dir>/mlflow_sweep.json`. Every job of the sweep (in-process,
joblib, submitit/SLURM) finds that file through its own Hydra config and logs as a child run
of the parent, tagged with its overrides, so MLflow's compare view lines the jobs up.
Creating the experiment once, up front, is what keeps parallel jobs from racing to create it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

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
    def __init__(self, experiment_name: str | None = None):
        """experiment_name: the experiment of the sweep; default `<experiment_name>-sweep-<sweep dir name>`."""
        self.experiment_name = experiment_name

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from t6.hardware.probes import env_rank
        from t6.tracking.mlflow import (
            EXPERIMENT_KIND_TAG,
            TRAINING_KIND,
            artifact_location,
            check_tracking_uri,
            mlflow_config,
            tag_training_experiment,
        )

        mlflow_cfg = mlflow_config(config)
        if mlflow_cfg is None or env_rank() != 0:
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        path = sweep_dir / SWEEP_FILE
        uri = mlflow_cfg.tracking_uri
        check_tracking_uri(uri)
        client = _client(uri)
        if path.is_file():  # the same sweep started again (fixed hydra.sweep.dir, after preemption): reuse it
            info = json.loads(path.read_text())
            client.update_run(info["parent_run_id"], status="RUNNING")
            return
        name = self.experiment_name or f"{config.experiment_name}-sweep-{sweep_dir.name}"
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            artifacts = artifact_location(uri, mlflow_cfg.get("artifact_dir"))
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

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from t6.hardware.probes import env_rank

        path = Path(config.hydra.sweep.dir) / SWEEP_FILE
        if env_rank() == 0 and path.is_file():
            info = json.loads(path.read_text())
            _client(info["tracking_uri"]).set_terminated(info["parent_run_id"], "FINISHED")


def read_sweep_file(sweep_dir: str | Path) -> dict:
    """The MLflow store, experiment and parent run a sweep directory (hydra.sweep.dir) recorded."""
    path = Path(sweep_dir) / SWEEP_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: {sweep_dir} is not the directory of a sweep "
            f"(python train.py -m ... with logger=mlflow writes it at the start)"
        )
    return json.loads(path.read_text())


def sweep_job_info() -> dict | None:
    """For a job of a multirun: the sweep's MLflow experiment and parent run, plus this job's overrides."""
    from hydra.core.hydra_config import HydraConfig

    from t6.config import in_multirun

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
