"""SIGTERM to every rank of a 2-process torchrun DDP run on the CPU, 0-100 ms apart (as SLURM signals the
tasks of a job on several nodes): does every rank stop, and is a resumable last.ckpt saved?

    PYTHONPATH=src python experiments/faults/sigterm_all_ranks.py --trials 6 --out experiments/faults/sigterm_after.json

Each trial starts `python -m torch.distributed.run --nproc-per-node=2 train.py trainer=ddp ...` (a tiny model),
waits for training to be under way (the first periodic checkpoint), sends SIGTERM to both workers in a random
order 0-100 ms apart, and waits `--timeout` seconds: a run still alive then is a hang (its processes are killed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = [
    "size=tiny",
    "size.n_layer=2",
    "size.d_model=64",
    "size.block_size=64",
    "trainer=ddp",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "trainer.precision=32-true",
    "trainer.max_steps=100000",
    "trainer.val_check_interval=1000",
    "trainer.log_every_n_steps=1",
    "data.batch_size=4",
    "data.global_batch_size=null",
    "data.val_windows=8",
    "eval=none",
    "callbacks.rich_model_summary=null",
    "callbacks.model_checkpoint.every_n_train_steps=2",
    "logger.mlflow.log_model=false",
    "samples=null",
]


def workers(proc: subprocess.Popen, count: int, deadline: float) -> list[psutil.Process]:
    """The training processes torchrun started (its children running train.py)."""
    while time.time() < deadline:
        found = [c for c in psutil.Process(proc.pid).children() if "train.py" in " ".join(c.cmdline())]
        if len(found) == count:
            return found
        time.sleep(0.2)
    raise TimeoutError("torchrun did not start its workers")


def trial(seed: int, root: Path, data_dir: Path, timeout: float) -> dict:
    rng = random.Random(seed)
    run_dir = root / f"run{seed}"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(T6_ROOT=str(root), PYTHONPATH=str(ROOT / "src"))
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    args += [str(ROOT / "train.py"), *OVERRIDES, f"paths.data_dir={data_dir}", f"hydra.run.dir={run_dir}"]
    log = open(root / f"run{seed}.log", "w")
    proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 600
    ranks = workers(proc, 2, deadline)
    while not list((run_dir / "checkpoints").glob("step*.ckpt")):
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"training did not start: {(root / f'run{seed}.log').read_text()[-2000:]}")
        time.sleep(0.2)
    time.sleep(rng.uniform(0, 1))
    order = rng.sample(ranks, 2)
    gap = rng.uniform(0, 0.1)
    order[0].send_signal(signal.SIGTERM)
    time.sleep(gap)
    order[1].send_signal(signal.SIGTERM)
    sent = time.time()
    try:
        code = proc.wait(timeout=timeout)
        hung = False
    except subprocess.TimeoutExpired:
        code, hung = None, True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    text = (root / f"run{seed}.log").read_text(errors="replace")
    last = run_dir / "checkpoints" / "last.ckpt"
    step = None
    if last.is_file():
        import torch

        step = int(torch.load(last, map_location="cpu", weights_only=True)["global_step"])
    return {
        "seed": seed,
        "gap_ms": round(gap * 1000, 1),
        "first_signalled": order[0].pid == ranks[0].pid and "rank order as started" or "reversed",
        "hung": hung,
        "exit_s": None if hung else round(time.time() - sent, 1),
        "torchrun_code": code,
        "worker_codes": sorted(int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", text)),
        "last_ckpt_step": step,
        "saved_on_stop": "last.ckpt saved" in text,  # train.py's line after the stop's checkpoint
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds after the signals before a hang")
    parser.add_argument("--out", type=Path, help="write the trials as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root, data = Path(tmp), Path(tmp) / "data"
        results = []
        for seed in range(args.trials):
            results.append(trial(seed, root, data, args.timeout))
            print(json.dumps(results[-1]), flush=True)
    hung = sum(r["hung"] for r in results)
    saved = sum(r["saved_on_stop"] for r in results)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    summary = {
        "benchmark": "faults_sigterm",  # python -m t6.report.experiments renders it
        "name": args.out.stem.removeprefix("sigterm_") if args.out else "",
        "commit": commit.stdout.strip(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores",
        "timeout_s": args.timeout,
        "trials": len(results),
        "hung": hung,
        "saved_on_stop": saved,
        "results": results,
    }
    print(f"{hung} of {len(results)} hung; {saved} saved last.ckpt when stopped")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
