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
    for noise in ("litlogger", "already configured with model summary", "limit_val_batches=1.0", "LeafSpec"):
        assert noise not in out, noise
    assert (tmp_path / "good" / "checkpoints" / "last.ckpt").is_file()


def test_a_sweep_accounts_for_every_job(tmp_path, shared_data_dir):
    """A 2-job sweep whose second job has a setting its plan refuses: the first trains; the second is a FAILED child
    run carrying its error; the parent run is FAILED with the counts; the command exits 2 naming the setting."""
    import json

    sweep = tmp_path / "sweep"
    args, env = command(
        tmp_path, shared_data_dir, "-m", "trainer.max_steps=2", "data.seq_len=32,128", f"hydra.sweep.dir={sweep}"
    )
    done = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "data.seq_len=128 is longer than size.block_size=64" in done.stderr
    info = json.loads((sweep / "mlflow_sweep.json").read_text())
    store = client(tmp_path)
    parent = store.get_run(info["parent_run_id"])
    assert parent.info.status == "FAILED"
    assert (parent.data.tags["jobs.finished"], parent.data.tags["jobs.failed"]) == ("1", "1")
    query = f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    jobs = {r.data.tags["sweep.job"]: r for r in store.search_runs([info["experiment_id"]], filter_string=query)}
    assert jobs["0"].info.status == "FINISHED" and jobs["1"].info.status == "FAILED"
    assert "data.seq_len=128 is longer than size.block_size=64" in jobs["1"].data.tags["error"]
