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
