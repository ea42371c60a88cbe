"""The run's MLflow logger: Lightning's MLFlowLogger whose writes go through an outbox (t6.tracking.outbox), so
training goes on while the tracking server is away, and a resume with the server down logs locally."""

from __future__ import annotations

import time
from pathlib import Path

from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment

from t6.tracking.outbox import Outbox, OutboxClient

STATUS = {"success": "FINISHED", "finished": "FINISHED", "failed": "FAILED"}


class OutboxMLFlowLogger(MLFlowLogger):
    """MLFlowLogger (rank 0 writes, as Lightning's; its log_metrics and log_hyperparams) whose `experiment` is an
    `OutboxClient`: metrics, params, tags, texts, artifacts and the run's status are spooled under `outbox_dir` and
    sent in order by a background thread, retried while the store does not answer. A new run is created at first
    use (the plan found the store reachable); a continued run (`run_id`) is not read first, so it logs while the
    store is down. `close()` at the end of the run waits up to `flush_timeout_s` for the store."""

    def __init__(
        self,
        experiment_name: str,
        run_name: str,
        tracking_uri: str,
        outbox_dir: str | Path,
        tags: dict | None = None,
        artifact_location: str | None = None,
        run_id: str | None = None,
        flush_timeout_s: float = 30.0,
    ):
        super().__init__(
            experiment_name=experiment_name,
            run_name=run_name,
            tracking_uri=tracking_uri,
            tags=tags,
            artifact_location=artifact_location,
            run_id=run_id,
        )
        self.tracking_uri, self.experiment_name, self.run_name = tracking_uri, experiment_name, run_name
        self.artifact_location, self.continued = artifact_location, run_id
        self.outbox_dir = Path(outbox_dir)
        self.flush_timeout_s = flush_timeout_s
        self.outbox: Outbox | None = None
        self.client: OutboxClient | None = None

    @property
    @rank_zero_experiment
    def experiment(self) -> OutboxClient:
        if self.client is None:
            from mlflow import MlflowClient

            store = MlflowClient(self.tracking_uri)
            run = self.create_run(store) if self.continued is None else read_run(store, self.continued, self.run_name)
            self.outbox = Outbox(self.tracking_uri, self.outbox_dir / "rank0.jsonl")
            self.client = OutboxClient(self.outbox, run)
        return self.client

    def create_run(self, store):
        """The experiment (created when the store has none of that name) and a new run in it, tagged as Lightning's
        MLFlowLogger tags it (the source and user tags MLflow adds, the run name)."""
        from mlflow.tracking.context.registry import resolve_tags

        experiment = store.get_experiment_by_name(self.experiment_name)
        if experiment is None or experiment.lifecycle_stage == "deleted":
            experiment_id = store.create_experiment(self.experiment_name, artifact_location=self.artifact_location)
        else:
            experiment_id = experiment.experiment_id
        return store.create_run(experiment_id, run_name=self.run_name, tags=resolve_tags(dict(self.tags or {})))

    @property
    def run_id(self) -> str | None:
        client = self.experiment
        return client.known_run.info.run_id if isinstance(client, OutboxClient) else self.continued

    @property
    def experiment_id(self) -> str | None:
        client = self.experiment
        return client.known_run.info.experiment_id if isinstance(client, OutboxClient) else None

    def finalize(self, status: str = "success") -> None:
        if self.client is not None:
            self.client.set_terminated(self.run_id, STATUS.get(status, status))

    def close(self, timeout_s: float | None = None) -> bool:
        """Send what waits (up to timeout_s, default flush_timeout_s) and stop the outbox; whether all was sent
        (what was not stays in the spool, and a warning names the command that sends it). A write after this
        only joins the spool."""
        if self.outbox is None:
            return True
        return self.outbox.close(self.flush_timeout_s if timeout_s is None else timeout_s)


def read_run(store, run_id: str, run_name: str):
    """The continued run as the store has it, or as this process knows it (id and name) while the store is down."""
    from mlflow.entities import Run, RunData, RunInfo

    try:
        return store.get_run(run_id)
    except Exception:  # unreachable (the plan said so): what this process knows
        info = RunInfo(run_id, "", "", "RUNNING", int(time.time() * 1000), None, "active", None, run_name)
        return Run(info, RunData())
