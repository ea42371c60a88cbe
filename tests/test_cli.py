"""`python train.py` in a subprocess whose stdout is a pipe (as under nohup or SLURM): plain progress
lines, then a real Ctrl-C (SIGINT) that saves a resumable last.ckpt and marks the MLflow run KILLED."""

from __future__ import annotations

import re
import signal
import subprocess
import time

import pytest
from test_distributed import ROOT, all_runs, client, command, run, step_of

pytestmark = pytest.mark.slow
LINE = re.compile(
    r"^step (\d+)/(\d+) \((\d+)%\) \| loss (\d+\.\d{4}) \| lr (\S+) \| ([\d,]+) tok/s \| elapsed \S+ \| ETA \S+$"
)


def test_ctrl_c_saves_last_ckpt_and_progress_lines_go_to_a_pipe(tmp_path, shared_data_dir):
    run_dir = tmp_path / "job"
    overrides = [
        "trainer.max_steps=100000",
        "callbacks.model_checkpoint.every_n_train_steps=1000",
        f"hydra.run.dir={run_dir}",
    ]
    args, env = command(tmp_path, shared_data_dir, *overrides)
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            lines, deadline = [], time.time() + 300
            while len([line for line in lines if line.startswith("step ")]) < 3:
                line = proc.stdout.readline()
                assert line and time.time() < deadline, (
                    "\n".join(lines[-5:]) + (tmp_path / "stderr.txt").read_text()[-3000:]
                )
                lines.append(line.rstrip("\n"))
            proc.send_signal(signal.SIGINT)  # Ctrl-C
            rest, _ = proc.communicate(timeout=120)
        finally:
            proc.kill()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 130, stderr[-3000:]
    assert "interrupted (Ctrl-C): last.ckpt saved" in stderr and "Traceback" not in stderr

    progress = [LINE.match(line) for line in lines + rest.splitlines() if line.startswith("step ")]
    assert all(progress), [line for line in lines if line.startswith("step ")]
    steps = [int(m[1]) for m in progress]
    assert steps[:3] == [1, 2, 3] and all(int(m[2]) == 100000 for m in progress)  # log_every_n_steps=1 in tests
    assert all(float(m[4]) > 0 and float(m[5]) > 0 for m in progress)

    saved = step_of(run_dir / "checkpoints" / "last.ckpt")  # no periodic checkpoint yet: saved by the interrupt
    assert saved >= 3 and not list((run_dir / "checkpoints").glob("step*.ckpt"))
    (killed,) = all_runs(client(tmp_path))
    assert killed.info.status == "KILLED"

    resumed = run(tmp_path, shared_data_dir, *overrides[1:], "ckpt_path=last", f"trainer.max_steps={saved + 2}")
    steps = [int(LINE.match(line)[1]) for line in resumed.stdout.splitlines() if LINE.match(line)]
    assert steps == [saved + 1, saved + 2]  # counted from the resumed step, against the same max_steps
    assert step_of(run_dir / "checkpoints" / "last.ckpt") == saved + 2
    (finished,) = all_runs(client(tmp_path))
    assert finished.info.run_id == killed.info.run_id and finished.info.status == "FINISHED"


def test_summary_multirun_prints_one_comparison_table(tmp_path):
    import os
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "summary.py"), "-m", "attention=mha,tpa", "size=tiny,small"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("| attention | size | layers x d_model | heads | params |") and len(lines) == 6
    assert [line.split(" | ")[:2] for line in lines[2:]] == [
        ["| mha", "tiny"],
        ["| mha", "small"],
        ["| tpa", "tiny"],
        ["| tpa", "small"],
    ]
    single = subprocess.run(
        [sys.executable, str(ROOT / "summary.py")], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert single.stdout.startswith("attention / size") and "tpa / tiny" in single.stdout  # train.py's default size


def test_a_bad_override_leaves_no_run_folder_and_a_run_prints_no_library_noise(tmp_path, shared_data_dir):
    args, env = command(tmp_path, shared_data_dir, "size.head_dim=63", f"hydra.run.dir={tmp_path / 'bad'}")
    proc = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "head_dim" in proc.stderr  # a config error: exit 2, no traceback
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "bad").exists()

    args, env = command(tmp_path, shared_data_dir, "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'good'}")
    args.remove("callbacks.rich_model_summary=null")  # the default summary, as users see it
    good = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = good.stdout + good.stderr
    assert good.returncode == 0, out[-3000:]
    assert "Total params" in out and "FLOPs" not in out  # the summary, without its column of zeros
    noises = ("litlogger", "already configured with model summary", "limit_val_batches=1.0", "LeafSpec", "Warning")
    for noise in noises:
        assert noise not in out, noise
    assert (tmp_path / "good" / "checkpoints" / "last.ckpt").is_file()


def test_a_sweep_accounts_for_every_job(tmp_path, shared_data_dir):
    """A 4-job sweep (a data.seq_len the plan refuses x a NaN loss at step 2 or never): one job trains, two are
    refused by their plans, one diverges. Each failure is said as it happens, and the sweep ends with a summary of
    every failed job's overrides and error (Hydra itself surfaces the first only); in MLflow each failed job is a
    FAILED child run with its error (the diverged one with its last_step), the parent FAILED with the counts; the
    command exits 2 (the first failure is the user's)."""
    import json

    sweep = tmp_path / "sweep"
    args, env = command(
        tmp_path, shared_data_dir, "-m", "trainer.max_steps=3", "data.seq_len=32,128",
        "+callbacks.nan._target_=test_resume.NaNAt", "+callbacks.nan.step=100,2", f"hydra.sweep.dir={sweep}",
    )  # fmt: skip
    done = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    output = done.stdout + done.stderr
    said = [line for line in output.splitlines() if "sweep job" in line and "failed:" in line]
    assert len(said) == 3, output[-3000:]  # as each failed
    summary = done.stderr[done.stderr.index(f"sweep {sweep}: 4 jobs: 1 finished, 3 failed") :].splitlines()
    assert summary[1:] == [  # the jobs by what they vary, the errors in their own words (a bug's with its type)
        "  job 1 (data.seq_len=32 +callbacks.nan.step=2): non-finite gradient norm (nan: a NaN or inf training loss "
        "on some rank) at step 2; stopping. No checkpoint was saved yet. Lower the learning rate, or set "
        "nonfinite_loss=skip to drop such steps",
        "  job 2 (data.seq_len=128 +callbacks.nan.step=100): Invalid run config: data.seq_len=128 is longer than "
        "size.block_size=64, the longest context the model is built for (its positions and caches); set "
        "data.seq_len<=64 or size.block_size=128",
        "  job 3 (data.seq_len=128 +callbacks.nan.step=2): Invalid run config: data.seq_len=128 is longer than "
        "size.block_size=64, the longest context the model is built for (its positions and caches); set "
        "data.seq_len<=64 or size.block_size=128",
    ]

    info = json.loads((sweep / "mlflow_sweep.json").read_text())
    store = client(tmp_path)
    parent = store.get_run(info["parent_run_id"])
    assert parent.info.status == "FAILED"
    assert (parent.data.tags["jobs.finished"], parent.data.tags["jobs.failed"]) == ("1", "3")
    query = f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    jobs = {r.data.tags["sweep.job"]: r for r in store.search_runs([info["experiment_id"]], filter_string=query)}
    assert jobs["0"].info.status == "FINISHED" and jobs["2"].info.status == "FAILED"
    assert "data.seq_len=128 is longer than size.block_size=64" in jobs["2"].data.tags["error"]
    assert jobs["1"].info.status == "FAILED" and jobs["1"].data.tags["last_step"] == "2"
    assert jobs["1"].data.tags["error"].startswith("Diverged: non-finite gradient norm (nan")


def test_a_sweep_of_optimizer_lr_under_a_schedule_is_refused_once_before_any_job(tmp_path, shared_data_dir):
    sweep = tmp_path / "sweep"
    args, env = command(tmp_path, shared_data_dir, "-m", "optimizer.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}")
    done = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.count("error: optimizer.lr is swept") == 1 and "sweep lr_ablation.max_lr=A,B" in done.stderr
    assert not sweep.exists() and not (tmp_path / "mlruns").exists()  # no job, no MLflow parent run
