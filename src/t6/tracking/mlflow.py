"""MLflow set-up: the logger factory used by conf/logger/mlflow.yaml, store checks that run
before training so an unreachable tracking server fails in seconds, not hours, the tag that
makes MLflow's UI open an experiment in its model-training view, and the upload of the final model.

A local SQLite store is created (schema and migrations) by the first process that reaches it,
under an exclusive lock on `<db>.lock`: training ranks, sweep jobs and array jobs started at the
same moment on a fresh store would otherwise race on MLflow's schema creation ("duplicate column
name"). On a cluster use a tracking server rather than SQLite on a shared filesystem (README,
"Tracking on a cluster")."""

from __future__ import annotations

import fcntl
import os
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from t6.errors import DamagedFile, SettingError, Unreachable

if TYPE_CHECKING:
    from lightning.pytorch.loggers import MLFlowLogger


def sqlite_file(uri: str) -> Path:
    """The database file of a `sqlite:///PATH` URI, as SQLAlchemy reads it (sqlite:////abs/x.db is /abs/x.db;
    urlparse's path would keep two leading slashes, which a file URI then reads as a host name)."""
    return Path(uri.removeprefix("sqlite:///")).absolute()


STORE_WAIT_S = 10.0  # how long a check waits for a server to answer, or for a locked SQLite store


class StoreUnreachable(Unreachable):
    """The tracking server does not answer (a new run stops here; a resume continues logging to its outbox)."""


def check_tracking_store(
    uri: str, run_id: str | None = None, ckpt_path: str | None = None, timeout_s: float | None = None
):
    """Fail early, naming the URI and the fix, when the tracking store cannot be reached (`StoreUnreachable` for
    a server), or does not hold the run a resumed checkpoint continues; a local store that is not a database, or
    stays locked, fails too. Reads only (`open_tracking_store` creates a local store)."""
    timeout_s = STORE_WAIT_S if timeout_s is None else timeout_s
    scheme = urlparse(uri).scheme
    if scheme in ("http", "https"):
        import urllib.request

        try:
            urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s)
        except OSError as err:
            raise StoreUnreachable(
                f"MLflow tracking server {uri} is unreachable ({err}); start it (e.g. `mlflow server --host 127.0.0.1 "
                "--port 5000`) or unset MLFLOW_TRACKING_URI to use the local SQLite store"
            ) from err
    elif scheme == "sqlite":
        path = sqlite_file(uri)
        existing = next(p for p in (path.parent, *path.parent.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK):
            raise Unreachable(f"cannot create the MLflow store directory {path.parent}: {existing} is not writable")
        if path.exists():
            check_sqlite_store(path, timeout_s)
    elif scheme in ("", "file"):
        if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() != "true":
            raise SettingError(
                f"tracking_uri={uri!r} is MLflow's deprecated file store; use sqlite:///ABSOLUTE/PATH/mlflow.db "
                "or a tracking server"
            )
    if run_id and not holds_run(uri, run_id):
        raise SettingError(
            f"ckpt_path={ckpt_path} continues MLflow run {run_id}, which the tracking store {uri} does not hold. "
            "Either point MLFLOW_TRACKING_URI at the store the interrupted run logged to, or continue the training "
            "(weights, optimizer, data position) as a new MLflow run with logger.mlflow.continue_run=false"
        )


def check_sqlite_store(path: Path, lock_wait_s: float = 10.0) -> None:
    """The SQLite store at path reads (a query of its schema): a file that is not a database, or one another process
    keeps locked for longer than lock_wait_s (SQLite retries meanwhile), is an error naming it. The connection may
    write, so a hot journal a killed writer left (SIGKILL mid-transaction) is rolled back by SQLite on this first
    read; a read-only connection could not ("attempt to write a readonly database")."""
    import sqlite3

    if not os.access(path, os.R_OK | os.W_OK):
        raise Unreachable(f"the MLflow store {path} cannot be read and written by this process; fix its permissions")
    try:
        with closing(sqlite3.connect(f"{path.as_uri()}?mode=rw", uri=True, timeout=lock_wait_s)) as db:
            db.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.OperationalError as err:
        if "locked" not in str(err) and "busy" not in str(err):
            raise Unreachable(f"the MLflow store {path} cannot be read: {err}") from None
        raise Unreachable(
            f"the MLflow store {path} is locked by another process ({lock_wait_s:g} s waited); let it finish, or "
            "run a tracking server for several writers (docs/tracking.md)"
        ) from None
    except sqlite3.DatabaseError as err:
        raise DamagedFile(
            f"{path} is not an SQLite database ({err}), so not an MLflow store; move it away (a new store is made "
            "there) or point MLFLOW_TRACKING_URI at the store"
        ) from None


def holds_run(uri: str, run_id: str) -> bool:
    """Whether the store at uri has the run (a local store that does not exist yet has none)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    if urlparse(uri).scheme == "sqlite" and not sqlite_file(uri).is_file():
        return False
    try:
        MlflowClient(tracking_uri=uri).get_run(run_id)
    except MlflowException:
        return False
    return True


def stored_steps(uri: str, run_id: str) -> dict[str, int]:
    """The highest step of each metric the store holds for run_id ({} when it cannot say)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    try:
        keys = list(client.get_run(run_id).data.metrics)
        return {key: max((m.step for m in client.get_metric_history(run_id, key)), default=-1) for key in keys}
    except Exception:  # the store away (a resume goes on in its outbox): the spool says what it can
        return {}


def open_tracking_store(uri: str) -> None:
    """Create a local SQLite store (its directory, schema and migrations); nothing for a server."""
    if urlparse(uri).scheme == "sqlite":
        path = sqlite_file(uri)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise Unreachable(f"cannot create the MLflow store directory {path.parent}: {err}") from err
        init_sqlite_store(uri)


def check_tracking_uri(uri: str, timeout_s: float | None = None) -> None:
    """`check_tracking_store`, then create a local store: for scripts that log right away (eval, report)."""
    check_tracking_store(uri, timeout_s=timeout_s)
    open_tracking_store(uri)


LOG_MODEL = ("final", "last", False)


def log_model_choice(value: bool | str | None) -> str | None:
    """`logger.mlflow.log_model`: "final" (true) uploads the weights-only final model, "last" the resumable
    last.ckpt (optimizer state included, ~3x larger), false nothing; one file per run, at the end."""
    if value is True:
        return "final"
    if value in (False, None, "false", "none"):
        return None
    if value not in LOG_MODEL:
        raise SettingError(
            f"logger.mlflow.log_model={value!r} must be final (the weights-only final model), "
            "last (the resumable last.ckpt) or false"
        )
    return value


def init_sqlite_store(uri: str) -> None:
    """Create (or migrate) the SQLite store at uri, one process at a time. Every later process
    finds the schema in place; the lock is held only for that check."""
    from mlflow import MlflowClient

    path = sqlite_file(uri)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)


def mlflow_logger(
    experiment_name: str,
    run_name: str,
    tracking_uri: str,
    outbox_dir: str,
    artifact_dir: str | None = None,
    log_model: bool | str = False,
    tags: dict | None = None,
    run_id: str | None = None,
    continue_run: bool = True,
    system_metrics: bool = True,
    system_metrics_interval_s: float = 10.0,
    flush_timeout_s: float = 30.0,
    logged_steps: dict[str, int] | None = None,
) -> MLFlowLogger:
    """The run's MLFlowLogger for tracking_uri, writing through an outbox under outbox_dir (t6.tracking.logger:
    training goes on while the store is away). A local SQLite store keeps its artifacts beside its database
    (or in artifact_dir). The run's plan (t6.run.plan) checks the store, chooses the run (`run_id`: the one a
    resume continues, unless continue_run is false), its name and tags, and reads the system-metrics and upload
    settings (log_model, carried out by `save_and_upload_model` after training); the execution passes its
    choices here."""
    from t6.tracking.logger import OutboxMLFlowLogger

    return OutboxMLFlowLogger(
        experiment_name=experiment_name,
        run_name=run_name,
        tracking_uri=tracking_uri,
        tags=dict(tags or {}),
        artifact_location=artifact_location(tracking_uri, artifact_dir),
        run_id=run_id,
        outbox_dir=outbox_dir,
        flush_timeout_s=flush_timeout_s,
        logged_steps=logged_steps,
    )


def artifact_location(tracking_uri: str, artifact_dir: str | None = None) -> str | None:
    """Where a new experiment in a local store keeps its artifacts: artifact_dir, else `artifacts/` beside
    the database (MLflow would otherwise use the working directory); a server decides for itself (None)."""
    if urlparse(tracking_uri).scheme != "sqlite":
        return None
    return Path(artifact_dir or sqlite_file(tracking_uri).parent / "artifacts").resolve().as_uri()


FINAL_MODEL = "model.ckpt"


def save_and_upload_model(
    trainer, logger: MLFlowLogger | None, checkpoint_dir: str | Path, upload: str | None
) -> str | None:
    """At the end of a finished run, as `upload` (logger.mlflow.log_model, `log_model_choice`) says: "final"
    uploads the weights-only model (`model.ckpt`: weights, model config and run config, no optimizer state; every
    rank takes part, rank 0 writes it and uploads it, and its local copy is removed once the store has it, so the
    run keeps last.ckpt and the store keeps the model); "last" uploads `last.ckpt`. Artifacts go under `model/`;
    returns the artifact's URI (rank 0)."""
    if logger is None or not upload or not checkpoint_dir:
        return None
    if upload == "final":
        path = Path(checkpoint_dir) / ".upload" / FINAL_MODEL
        trainer.save_checkpoint(path, weights_only=True)
        trainer.strategy.checkpoint_io.teardown()  # a background writer's copy is on disk before it is uploaded
    else:
        path = Path(checkpoint_dir) / "last.ckpt"
    if not trainer.is_global_zero:
        return None
    if not path.is_file():
        raise FileNotFoundError(f"logger.mlflow.log_model={upload}: {path} was not written")
    logger.experiment.log_artifact(logger.run_id, str(path), artifact_path="model", remove_after=upload == "final")
    artifact_uri = logger.experiment.get_run(logger.run_id).info.artifact_uri
    return f"{artifact_uri}/model/{path.name}" if artifact_uri else None


# MLflow's UI picks the view an experiment opens in from this tag: model training ("custom model
# development": runs, charts, system metrics) rather than GenAI (traces, evaluation runs).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"


def ui_path(experiment_id: str, run_id: str | None = None) -> str:
    """The MLflow UI route of an experiment (or run) in the model-training view. MLflow 3.17's UI
    takes its view from the `workflowType` URL parameter, falling back to the browser's last
    choice (GenAI on a first visit), so the links t6 prints carry it."""
    route = f"#/experiments/{experiment_id}" + (f"/runs/{run_id}" if run_id else "")
    return f"{route}?workflowType=machine_learning"


def tag_training_experiment(client, experiment_id: str) -> None:
    """Mark an experiment as model training for MLflow's UI (idempotent)."""
    experiment = client.get_experiment(experiment_id)
    if experiment.tags.get(EXPERIMENT_KIND_TAG) != TRAINING_KIND:
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)
