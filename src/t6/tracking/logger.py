"""The run's MLflow logger: Lightning's MLFlowLogger whose writes go through an outbox (t6.tracking.outbox), so
training goes on while the tracking server is away, and a resume with the server down logs locally."""

from __future__ import annotations

import time
from pathlib import Path

from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment

from t6.tracking.outbox import Outbox, OutboxClient, quick_http_failures
from t6.training.lightning_private import tracking_uri

STATUS = {"success": "FINISHED", "finished": "FINISHED", "failed": "FAILED"}


class OutboxMLFlowLogger(MLFlowLogger):
    """MLFlowLogger (rank 0 writes, as Lightning's) whose `experiment` is an `OutboxClient`: metrics, params,
    tags, texts, artifacts and the run's status are spooled under `outbox_dir` and sent in order by a background
    thread, retried with backoff while the store does not answer. A new run is created at first use (the plan
    found the store reachable); a continued run (`run_id`) is not read first, so it logs while the store is down.
    `close()` at the end of the run waits up to `flush_timeout_s` for the store."""

    def __init__(self, *args, outbox_dir: str | Path, flush_timeout_s: float = 30.0, **kwargs):
        quick_http_failures()  # before any request: the first read of a continued run may find the server down
        super().__init__(*args, **kwargs)
        self.outbox_dir = Path(outbox_dir)
        self.flush_timeout_s = flush_timeout_s
        self.outbox: Outbox | None = None
        self._client: OutboxClient | None = None

    @property
    @rank_zero_experiment
    def experiment(self) -> OutboxClient:
        if self._client is not None:
            return self._client
        if self._run_id is None:
            client = MLFlowLogger.experiment.fget(self)  # creates the experiment and the run now
            known = client.get_run(self._run_id)
        else:
            self._initialized = True  # Lightning would read the run first: not while the store is down
            known = self.read_run(self._run_id)
        self.outbox = Outbox(tracking_uri(self), self.outbox_dir / "rank0.jsonl")
        self._client = OutboxClient(self.outbox, known)
        return self._client

    def read_run(self, run_id: str):
        """The continued run as the store has it, or as this process knows it while the store is down."""
        from mlflow.entities import Run, RunData, RunInfo

        try:
            run = self._mlflow_client.get_run(run_id)
        except Exception:  # unreachable (the plan said so): what this process knows
            info = RunInfo(run_id, "", "", "RUNNING", int(time.time() * 1000), None, "active", None, self._run_name)
            return Run(info, RunData())
        self._experiment_id = run.info.experiment_id
        return run

    def finalize(self, status: str = "success") -> None:
        if self._client is not None:
            self._client.set_terminated(self._run_id, STATUS.get(status, status))

    def close(self, timeout_s: float | None = None) -> bool:
        """Send what waits (up to timeout_s, default flush_timeout_s) and stop the outbox; whether all was sent
        (what was not stays in the spool, and a warning names the command that sends it). A write after this
        only joins the spool."""
        if self.outbox is None:
            return True
        return self.outbox.close(self.flush_timeout_s if timeout_s is None else timeout_s)
