"""`python train.py` as users run it, in subprocesses: 2-process CPU DDP (gloo) as a single run and
inside a 2-job multirun, a sweep's MLflow parent and child runs, and a real SIGTERM to a training
process followed by a resume. Slow: each starts Lightning (and DDP starts it twice)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
import torch

from conftest import ROOT, TEST_RUN, TEST_SIZE

pytestmark = pytest.mark.slow
DDP = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]


def command(tmp_path: Path, data_dir: Path, *overrides: str) -> tuple[list[str], dict]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(T6_ROOT=str(tmp_path), PYTHONPATH=str(ROOT / "src"), MLFLOW_ENABLE_ASYNC_LOGGING="false")
    flags = [o for o in overrides if o.startswith("-")]  # -m goes before the overrides
    rest = [o for o in overrides if not o.startswith("-")]
    if not any(o.startswith("eval") for o in rest):
        rest.insert(0, "eval=none")  # downstream evaluation only where a test asks for it
    args = [sys.executable, str(ROOT / "train.py"), *flags, *TEST_SIZE, *TEST_RUN, f"paths.data_dir={data_dir}", *rest]
    return args, env


def run(tmp_path: Path, data_dir: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    args, env = command(tmp_path, data_dir, *overrides)
    proc = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def client(tmp_path: Path) -> mlflow.MlflowClient:
    return mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns/mlflow.db")


def all_runs(c: mlflow.MlflowClient):
    return c.search_runs([e.experiment_id for e in c.search_experiments()])


def step_of(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


def test_ddp_two_processes_run_and_resume_exactly(tmp_path, shared_data_dir):
    first = tmp_path / "first"
    run(tmp_path, shared_data_dir, *DDP, "data.batch_size=2", "data.global_batch_size=8",  # 2 ranks x 2 x accumulate 2
        "callbacks.model_checkpoint.save_top_k=-1", f"hydra.run.dir={first}")
    assert step_of(first / "checkpoints" / "last.ckpt") == 8
    (run_,) = all_runs(client(tmp_path))  # ranks 1.. log nothing of their own
    resumed = tmp_path / "resumed"
    run(tmp_path, shared_data_dir, *DDP, "data.batch_size=2", "data.global_batch_size=8",
        f"ckpt_path={first / 'checkpoints' / 'step000004.ckpt'}", f"hydra.run.dir={resumed}")
    assert step_of(resumed / "checkpoints" / "last.ckpt") == 8
    assert len(all_runs(client(tmp_path))) == 1  # the resumed run logged into the same MLflow run
    history: dict[int, list[float]] = {}
    for m in client(tmp_path).get_metric_history(run_.info.run_id, "train/loss"):
        history.setdefault(m.step, []).append(m.value)
    assert sorted(history) == list(range(8))
    for step in range(4, 8):  # logged by the uninterrupted run and again by the resumed one
        assert len(history[step]) == 2 and history[step][0] == pytest.approx(history[step][1], abs=1e-6), step


def test_ddp_evaluation_runs_on_rank_zero_while_the_other_rank_waits(tmp_path, shared_data_dir):
    run(tmp_path, shared_data_dir, *DDP, "eval=local", "eval.limit=8", "eval.num_fewshot=[0]", "eval.every_n_steps=4",
        f"hydra.run.dir={tmp_path / 'run'}")
    (run_,) = all_runs(client(tmp_path))
    history = client(tmp_path).get_metric_history(run_.info.run_id, "eval/0shot/t6_next_line/acc_norm")
    assert sorted(m.step for m in history) == [4, 8]  # once per evaluation (every 4 steps, not again at the end of step 8), not once per rank
    assert step_of(tmp_path / "run" / "checkpoints" / "last.ckpt") == 8  # training went on after each evaluation


def test_ddp_inside_a_multirun_runs_each_job_once(tmp_path, shared_data_dir):
    sweep = tmp_path / "sweep"
    run(tmp_path, shared_data_dir, "-m", "attention=mha,tpa", *DDP, f"hydra.sweep.dir={sweep}")
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    for job in ("0", "1"):
        assert step_of(sweep / job / "checkpoints" / "last.ckpt") == 8
    assert not (tmp_path / "logs").exists()  # no child re-ran the sweep into a default sweep dir
    c = client(tmp_path)
    runs = all_runs(c)
    assert len(runs) == 3  # one parent, one child per job, nothing from the DDP children
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.data.tags["override.attention"] for r in children) == ["mha", "tpa"]
    assert c.get_experiment(parent.info.experiment_id).name == "t6-sweep-sweep"


def test_sweep_has_one_parent_and_a_child_per_job(tmp_path, shared_data_dir):
    run(tmp_path, shared_data_dir, "-m", "attention=mha,tpa", "hydra.callbacks.mlflow_sweep.experiment_name=my-study")
    c = client(tmp_path)
    experiment = c.get_experiment_by_name("my-study")
    runs = c.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(runs) == 3 and len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert {r.data.tags["sweep.params"] for r in children} == {"attention=mha", "attention=tpa"}
    assert {r.info.run_name for r in children} == {"attention=mha", "attention=tpa"}
    assert all(r.info.status == "FINISHED" and "train/loss" in r.data.metrics for r in children)


def test_sigterm_saves_a_checkpoint_and_the_rerun_resumes(tmp_path, shared_data_dir):
    run_dir = tmp_path / "job"
    overrides = ["trainer.max_steps=100000", "auto_resume=true", "callbacks.model_checkpoint.every_n_train_steps=2", f"hydra.run.dir={run_dir}"]
    args, env = command(tmp_path, shared_data_dir, *overrides)
    proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not list((run_dir / "checkpoints").glob("step*.ckpt")):  # training is under way
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-3000:]
    assert "last.ckpt saved" in stderr and "Traceback" not in stderr
    saved = step_of(run_dir / "checkpoints" / "last.ckpt")
    assert saved >= 2
    (killed,) = all_runs(client(tmp_path))
    assert killed.info.status == "KILLED"

    rerun = run(tmp_path, shared_data_dir, *overrides[1:], f"trainer.max_steps={saved + 2}")  # same run dir: auto-resume
    assert "Restoring states from the checkpoint path at" in rerun.stdout + rerun.stderr
    assert step_of(run_dir / "checkpoints" / "last.ckpt") == saved + 2
    (resumed,) = all_runs(client(tmp_path))
    assert resumed.info.run_id == killed.info.run_id and resumed.info.status == "FINISHED"
