"""The local MLflow store under concurrency: processes starting together on a fresh SQLite store."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import mlflow
import pytest

from conftest import ROOT

STARTER = """
import sys, time
from t6.tracking.mlflow import check_tracking_uri
uri, start, name = sys.argv[1], float(sys.argv[2]), sys.argv[3]
time.sleep(max(0.0, start - time.time()))  # all three reach the fresh store at the same moment
check_tracking_uri(uri)
import mlflow
client = mlflow.MlflowClient(uri)
run = client.create_run(client.get_experiment_by_name("Default").experiment_id, run_name=name)
client.log_metric(run.info.run_id, "train/loss", 1.0, step=0)
"""


@pytest.mark.slow  # three Python processes importing MLflow (~20 s)
def test_three_processes_start_on_a_fresh_sqlite_store(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlruns/mlflow.db"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "MLFLOW_ENABLE_ASYNC_LOGGING": "false"}
    start = time.time() + 15  # past the imports of all three (mlflow only)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", STARTER, uri, str(start), f"job{i}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(err[-2000:] for _, err in outs)
    runs = mlflow.MlflowClient(uri).search_runs(["0"])
    assert sorted(r.info.run_name for r in runs) == ["job0", "job1", "job2"]


KILLED_WRITER = """
import os, signal, sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA cache_size=1")  # every changed page spills into the file, its original into the journal
db.execute("BEGIN IMMEDIATE")
db.execute("CREATE TABLE filler (x BLOB)")
for _ in range(64):
    db.execute("INSERT INTO filler VALUES (zeroblob(4096))")
db.execute("UPDATE experiments SET name = 'half written' WHERE experiment_id = 0")
os.kill(os.getpid(), signal.SIGKILL)  # mid-transaction, as a run killed while it logged
"""


def test_a_store_a_killed_writer_left_with_a_hot_journal_is_recovered(tmp_path):
    """SIGKILL during a write leaves a hot rollback journal beside the store. The store check opens it read-write,
    so SQLite rolls the journal back (a read-only connection cannot: "attempt to write a readonly database"), and
    the store holds what it held before the killed transaction."""
    import sqlite3

    from t6.tracking.mlflow import check_tracking_store, init_sqlite_store

    path = tmp_path / "mlflow.db"
    init_sqlite_store(f"sqlite:///{path}")
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(path)], capture_output=True, timeout=60)
    assert killed.returncode == -9, killed.stderr
    journal = path.with_name(path.name + "-journal")
    assert journal.is_file() and journal.stat().st_size > 0  # hot: the transaction's originals, never rolled back

    check_tracking_store(f"sqlite:///{path}")
    assert not journal.exists() or journal.stat().st_size == 0  # rolled back
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT name FROM experiments WHERE experiment_id = 0").fetchone() == ("Default",)
        assert db.execute("SELECT count(*) FROM sqlite_master WHERE name = 'filler'").fetchone() == (0,)
    assert mlflow.MlflowClient(f"sqlite:///{path}").get_experiment("0").name == "Default"
