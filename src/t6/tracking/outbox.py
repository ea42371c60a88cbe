"""Tracking that survives its server: every write a training process makes to its MLflow run goes through an
`Outbox`, so a tracking server that stops answering (restarted, unreachable, down at a resume) never stalls or
kills training.

A run makes MLflow's client fail a request fast while it logs (t6.run.process.run_settings): the outbox retries.

- `Outbox.put(record)` appends the write to a spool file (JSON lines, one file per writing process) and
  returns; a background thread sends the spool's writes in order, and while the store does not answer it
  retries with exponential backoff (1 s doubling to `max_backoff_s`), keeping the rest waiting in order.
- The spool's `.sent` file counts the writes the store acknowledged. A later process on the same spool (a
  resumed or requeued run) sends what an earlier one left first; `python -m t6.tracking.sync RUN_DIR` sends
  it by hand (the command a run prints when it ends with writes unsent).
- `OutboxClient` is the MLflow client a run's code sees (`logger.experiment`): MlflowClient's write methods
  go to the outbox; reads go to the store, and `get_run` answers with the run as last read while the store
  is unreachable.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SYNC_COMMAND = "python -m t6.tracking.sync"
METRICS_PER_BATCH = 1000  # MLflow's log_batch limit


class Outbox:
    """Writes to an MLflow store, spooled to `spool` (a .jsonl file) and sent in order by a background thread."""

    def __init__(self, tracking_uri: str, spool: str | Path, max_backoff_s: float = 60.0):
        from mlflow import MlflowClient

        self.uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.spool = Path(spool)
        self.sent_file = self.spool.with_suffix(".sent")
        self.max_backoff_s = max_backoff_s
        self.pending: deque[dict] = deque(unsent(self.spool))  # what an earlier process on this spool left
        self.sent = sent_count(self.sent_file)
        self.unreachable_since: float | None = None
        self.error: str | None = None  # the store's last answer while unreachable
        self.cond = threading.Condition()
        self.closing = False
        self.spool.parent.mkdir(parents=True, exist_ok=True)
        new = not self.spool.exists()
        self.file = open(self.spool, "a", encoding="utf-8")
        if not new and not self.spool.read_bytes().endswith(b"\n"):
            self.file.write("\n")  # ends a line cut short when an earlier process was killed
        if new:
            self.file.write(json.dumps({"op": "header", "tracking_uri": tracking_uri}) + "\n")
            self.file.flush()
            self.sent += 1
            write_sent(self.sent_file, self.sent)
        self.thread = threading.Thread(target=self.run, name=f"mlflow-outbox:{self.spool.name}", daemon=True)
        self.thread.start()

    def put(self, record: dict) -> None:
        with self.cond:
            if self.file.closed:  # after close(): the spool keeps it for `sync`
                with open(self.spool, "a", encoding="utf-8") as file:
                    file.write(json.dumps(record) + "\n")
                return
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
            self.pending.append(record)
            self.cond.notify_all()

    def run(self) -> None:
        backoff = 1.0
        while True:
            with self.cond:
                while not self.pending and not self.closing:
                    self.cond.wait()
                if not self.pending or (self.closing and self.unreachable_since is not None):
                    return
                batch = take_batch(self.pending)
            try:
                send(self.client, batch)
            except Exception as err:  # the store's errors have no common type (HTTP, SQL, connection)
                if refused(err):  # the store answered and said no: retrying cannot help, the rest must go on
                    log.error("MLflow store %s refused a write, dropped (%s): %s", self.uri, err, batch[0])
                    self.done(batch)
                    continue
                with self.cond:
                    if self.unreachable_since is None:
                        self.unreachable_since = time.time()
                        log.warning("MLflow store %s not answering (%s); training goes on, writes wait", self.uri, err)
                    self.error = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                    if not self.closing:
                        self.cond.wait(backoff)  # flush() and close() wake it for one more try
                    backoff = min(2 * backoff, self.max_backoff_s)
                continue
            with self.cond:
                self.done(batch)
                if self.unreachable_since is not None:
                    log.warning(
                        "MLflow store %s answers again after %.0f s; sending the writes that waited",
                        self.uri,
                        time.time() - self.unreachable_since,
                    )
                self.unreachable_since, self.error, backoff = None, None, 1.0
                self.cond.notify_all()

    def done(self, batch: list[dict]) -> None:
        """The store has dealt with these (the first pending writes): count them as sent."""
        with self.cond:
            for _ in batch:
                self.pending.popleft()
            self.sent += len(batch)
            write_sent(self.sent_file, self.sent)

    def flush(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for every write so far to be sent; whether they were."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            self.cond.notify_all()
            while self.pending and time.monotonic() < deadline:
                self.cond.wait(min(1.0, deadline - time.monotonic()))
            return not self.pending

    def close(self, timeout_s: float) -> bool:
        """Flush (up to timeout_s) and stop the thread. Writes still unsent stay in the spool: a warning names
        the command that sends them."""
        done = self.flush(timeout_s)
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.thread.join(timeout=15)  # a request under way ends within MLflow's HTTP timeout
        with self.cond:
            left = len(self.pending)
            self.file.close()
        if left:
            log.warning(
                "MLflow store %s unreachable (%s): %d write(s) of this run wait in %s; send them with `%s %s`",
                self.uri,
                self.error,
                left,
                self.spool,
                SYNC_COMMAND,
                self.spool.parent,
            )
        return done and not left


def refused(err: BaseException) -> bool:
    """Whether the store answered and refused the write (a 4xx: a bad value, a run it does not hold), rather
    than not answering (a connection error, a 5xx, a locked database: worth retrying)."""
    from mlflow.exceptions import MlflowException

    return isinstance(err, MlflowException) and 400 <= err.get_http_status_code() < 500


def take_batch(pending: deque[dict]) -> list[dict]:
    """The first pending write, with the metric-only writes of the same run that follow it (one request)."""
    first = pending[0]
    batch = [first]
    if first["op"] != "log_batch" or first.get("params") or first.get("tags"):
        return batch
    count = len(first["metrics"])
    for record in list(pending)[1:]:
        plain = record["op"] == "log_batch" and not record.get("params") and not record.get("tags")
        if not plain or record["run_id"] != first["run_id"] or count + len(record["metrics"]) > METRICS_PER_BATCH:
            break
        batch.append(record)
        count += len(record["metrics"])
    return batch


def send(client, batch: list[dict]) -> None:
    """Carry out spooled writes on an MlflowClient (a batch is one write, or metric-only writes of one run)."""
    from mlflow.entities import Metric, Param, RunTag

    first = batch[0]
    op, run_id = first["op"], first.get("run_id")
    if op == "log_batch":
        metrics = [Metric(k, v, ts, step) for record in batch for k, v, ts, step in record["metrics"]]
        params = [Param(k, v) for k, v in first.get("params", {}).items()]
        tags = [RunTag(k, v) for k, v in first.get("tags", {}).items()]
        for i in range(0, max(len(metrics), 1), METRICS_PER_BATCH):  # params and tags go with the first part
            client.log_batch(
                run_id,
                metrics=metrics[i : i + METRICS_PER_BATCH],
                params=params if i == 0 else [],
                tags=tags if i == 0 else [],
            )
    elif op == "set_terminated":
        client.set_terminated(run_id, first["status"], end_time=first["end_time"])
    elif op == "update_run":
        client.update_run(run_id, status=first["status"])
    elif op == "log_text":
        client.log_text(run_id, first["text"], first["artifact_file"])
    elif op == "log_artifact":
        path = Path(first["local_path"])
        if path.exists():  # a file removed since (a later upload replaced it) has nothing left to send
            client.log_artifact(run_id, str(path), first.get("artifact_path"))
            if first.get("remove_after"):
                path.unlink()
                if path.parent.name == ".upload" and not any(path.parent.iterdir()):
                    path.parent.rmdir()
    elif op in ("header", "skip"):
        pass
    else:
        raise ValueError(f"unknown outbox write {op!r}")


def unsent(spool: Path) -> list[dict]:
    """The writes of a spool the store has not acknowledged (none when the spool does not exist)."""
    if not spool.exists():
        return []
    lines = spool.read_text(encoding="utf-8").splitlines()
    records = []
    for line in lines[sent_count(spool.with_suffix(".sent")) :]:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short when its process was killed: counted, not sent
            records.append({"op": "skip"})
    return records


def sent_count(path: Path) -> int:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return 0


def write_sent(path: Path, count: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(count))
    os.replace(tmp, path)


class OutboxClient:
    """The MLflow client of a run that logs through an `Outbox`: MlflowClient's writes (log_batch, log_metric,
    log_param, set_tag, set_terminated, update_run, log_text, log_artifact) are spooled and return at once;
    any other method reads the store. `get_run` answers with the run as last read (or as this process knows
    it: id and name) while the store does not answer."""

    def __init__(self, outbox: Outbox, known_run=None):
        self.outbox = outbox
        self.known_run = known_run

    def __getattr__(self, name: str) -> Any:
        return getattr(self.outbox.client, name)

    def log_batch(self, run_id, metrics=(), params=(), tags=(), synchronous=None) -> None:
        self.outbox.put(
            {
                "op": "log_batch",
                "run_id": run_id,
                "metrics": [[m.key, m.value, m.timestamp, m.step] for m in metrics],
                "params": {p.key: p.value for p in params},
                "tags": {t.key: t.value for t in tags},
            }
        )

    def log_metric(self, run_id, key, value, timestamp=None, step=None, synchronous=None) -> None:
        from mlflow.entities import Metric

        self.log_batch(run_id, metrics=[Metric(key, value, timestamp or int(time.time() * 1000), step or 0)])

    def log_param(self, run_id, key, value, synchronous=None) -> None:
        self.outbox.put({"op": "log_batch", "run_id": run_id, "metrics": [], "params": {key: str(value)}})

    def set_tag(self, run_id, key, value, synchronous=None) -> None:
        self.outbox.put({"op": "log_batch", "run_id": run_id, "metrics": [], "tags": {key: str(value)}})

    def set_terminated(self, run_id, status="FINISHED", end_time=None) -> None:
        end = end_time or int(time.time() * 1000)
        self.outbox.put({"op": "set_terminated", "run_id": run_id, "status": status, "end_time": end})

    def update_run(self, run_id, status=None, name=None) -> None:
        self.outbox.put({"op": "update_run", "run_id": run_id, "status": status})

    def log_text(self, run_id, text, artifact_file) -> None:
        self.outbox.put({"op": "log_text", "run_id": run_id, "text": text, "artifact_file": artifact_file})

    def log_artifact(self, run_id, local_path, artifact_path=None, remove_after: bool = False) -> None:
        """remove_after: delete the local file once the store has it (an upload that is not kept twice)."""
        record = {"op": "log_artifact", "run_id": run_id, "local_path": str(Path(local_path).resolve())}
        self.outbox.put({**record, "artifact_path": artifact_path, "remove_after": remove_after})

    def get_run(self, run_id):
        try:
            run = self.outbox.client.get_run(run_id)
        except Exception:  # unreachable: the run as last read
            if self.known_run is None or self.known_run.info.run_id != run_id:
                raise
            return self.known_run
        self.known_run = run
        return run
