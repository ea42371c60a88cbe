"""Fault-injection trials inside long-lived torchrun workers (tests/test_faults.py starts them):

    python -m torch.distributed.run --nproc-per-node=N tests/fault_worker.py SPEC.json

Every rank runs the same list of trials in one process (one Lightning import, one process group shared by the
trials: `execute` leaves the group up here). A trial is a training run, `main(cfg)` of t6.run.train as `python
train.py` runs it, with `FaultInjector` sending real signals (os.kill of this process, from a timer thread so they
land asynchronously) to the ranks and at the moments the spec names (a training step, validation, a downstream
evaluation, a checkpoint write), ending in the run's own exit (t6.training.stop.hand_over's SystemExit, caught here),
then the same run resumed (auto_resume) to its end. A submitit trial runs under submitit's own signal
handlers, as `submitit` installs them in a job. Each rank writes what it saw to `<root>/rank<r>.json`
after every trial; `faulthandler` ends a trial that hangs (stack dump, exit code 3)."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import lightning as L
import torch
from omegaconf import open_dict

from conftest import TEST_RUN, TEST_SIZE, compose_config

EVAL_EVERY = 5  # a downstream evaluation after every 5th step, in trials that signal during one
SIGNALS = {s.name: s for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)}


class FaultInjector(L.Callback):
    """Sends this process `signal` at `phase` of optimizer step `step` (after `delay_ms`, from a timer thread):
    train (the step's forward/backward), validation (its first batch), eval (the downstream evaluation after
    the step) or checkpoint (the periodic save after the step). Records where the signal landed."""

    def __init__(self, events: list, record: str, eval_every: int | None = None):
        rank = int(os.environ.get("RANK", 0))
        self.events = [dict(e) for e in events if e["rank"] == rank]
        self.eval_every = eval_every
        self.record = Path(record)
        self.phase = "setup"
        self.landed: list[dict] = []

    def fire(self, trainer, event: dict) -> None:
        def send():
            self.landed.append({**event, "landed_phase": self.phase, "landed_step": trainer.global_step})
            self.record.write_text(json.dumps(self.landed))
            os.kill(os.getpid(), SIGNALS[event["signal"]])

        threading.Timer(event["delay_ms"] / 1000, send).start()

    def due(self, trainer, phase: str) -> list[dict]:
        return [
            e for e in self.events if e["phase"] == phase and e["step"] == trainer.global_step and not e.get("sent")
        ]

    def at(self, trainer, phase: str) -> None:
        self.phase = phase
        for event in self.due(trainer, phase):
            event["sent"] = True
            self.fire(trainer, event)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.at(trainer, "train")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.at(trainer, "validation")

    def on_validation_end(self, trainer, pl_module):
        self.phase = "train"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        every = self.eval_every
        self.at(trainer, "eval" if every and trainer.global_step % every == 0 else "after step")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.at(trainer, "checkpoint")


class FillDisk(L.Callback):
    """Where no file system can be mounted for the test: from optimizer step `step` on, rank 0 may write no file
    larger than `max_bytes` (RLIMIT_FSIZE, SIGXFSZ ignored so the write fails with EFBIG), as a disk with
    `max_bytes` left would refuse a checkpoint."""

    def __init__(self, step: int, max_bytes: int):
        self.step, self.max_bytes = step, max_bytes

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        import resource

        if trainer.global_step == self.step and trainer.global_rank == 0:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.max_bytes, resource.RLIM_INFINITY))


class Pace(L.Callback):
    """Each optimizer step takes at least `seconds` (a run long enough for a server to go away and come back)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(self.seconds)


class Recorder(L.Callback):
    """Per optimizer step: this rank's training loss (written to `path` at the end of each step; `{rank}` in it is
    the process's rank)."""

    def __init__(self, path: str):
        self.path = Path(path.replace("{rank}", os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))))
        self.loss = json.loads(self.path.read_text()) if self.path.exists() else {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.loss[str(trainer.global_step)] = outputs["loss"].item()
        self.path.write_text(json.dumps(self.loss))


def config(spec: dict, trial: dict, run_dir: Path, *extra: str):
    overrides = [
        *TEST_SIZE,
        *TEST_RUN,
        "trainer=ddp",
        "trainer.accelerator=cpu",
        f"trainer.devices={spec['world']}",
        "trainer.precision=32-true",
        f"trainer.max_steps={spec['steps']}",
        "trainer.val_check_interval=3",
        "callbacks.model_checkpoint.every_n_train_steps=4",
        "logger.mlflow.system_metrics=false",
        "samples=null",
        "data.batch_size=2",
        "data.seq_len=32",
        "data.val_windows=4",
        "+trainer.enable_model_summary=false",
        f"experiment_name={trial['name']}",
        *(
            ["eval=local", "eval.limit=4", "eval.num_fewshot=[0]", f"eval.every_n_steps={EVAL_EVERY}"]
            if trial["eval"]
            else []
        ),
        *([] if trial["eval"] else ["eval=none"]),
        *extra,
    ]
    cfg = compose_config(overrides, Path(spec["root"]))
    rank = int(os.environ["RANK"])
    with open_dict(cfg):
        cfg.paths.output_dir = str(run_dir)
        cfg.paths.data_dir = spec["data_dir"]
        cfg.callbacks.recorder = {"_target_": "fault_worker.Recorder", "path": str(run_dir / f"loss{rank}.json")}
    return cfg


def stop_and_hand_over(cfg) -> dict:
    """`main(cfg)`, the run `python train.py` is: a stop saves the checkpoint and hands the signal over, whose exit
    (128 + signum) this catches."""
    from t6.run.train import main
    from t6.training.stop import RunStopped

    start = time.time()
    try:
        _, objects = main(cfg)
    except SystemExit as exit_:  # hand_over's (or its earlier owner's: submitit's), raised handling the stop
        stop = exit_.__context__
        assert isinstance(stop, RunStopped), repr(stop)
        name = signal.Signals(stop.signum).name
        return {"stopped": True, "signal": name, "seconds": time.time() - start, "exit_code": exit_.code}
    return {"stopped": False, "global_step": objects["trainer"].global_step, "seconds": time.time() - start}


def submitit_handlers(root: Path, rank: int, world: int, record: Path) -> None:
    """submitit's signal handlers, as a submitit job has them (LocalJobEnvironment: its requeue exits 144); the
    job's `checkpoint` records which last.ckpt existed when submitit asked for the requeue."""
    from submitit.core.utils import DelayedSubmission, JobPaths
    from submitit.local.local import LocalJobEnvironment

    os.environ.update(
        SUBMITIT_LOCAL_JOB_ID="faults",
        SUBMITIT_LOCAL_NTASKS=str(world),
        SUBMITIT_LOCAL_JOB_NUM_NODES="1",
        SUBMITIT_LOCAL_NODEID="0",
        SUBMITIT_LOCAL_GLOBALID=str(rank),
        SUBMITIT_LOCAL_LOCALID=str(rank),
        SUBMITIT_FOLDER=str(root / "submitit"),
    )
    delayed = DelayedSubmission(Job(record))
    delayed.set_timeout(60, 3)
    paths = JobPaths(root / "submitit", job_id="faults", task_id=rank)
    paths.submitted_pickle.parent.mkdir(parents=True, exist_ok=True)
    LocalJobEnvironment()._handle_signals(paths, delayed)


class Job:
    """A submitit job function: `checkpoint` is what submitit calls before it requeues."""

    def __init__(self, record: Path):
        self.record = record

    def __call__(self):
        return None

    def checkpoint(self):
        from submitit.core.utils import DelayedSubmission

        last = self.record.parent / "checkpoints" / "last.ckpt"
        step = torch.load(last, map_location="cpu", weights_only=True)["global_step"] if last.exists() else None
        self.record.write_text(json.dumps({"last_ckpt_step_at_requeue": step}))
        return DelayedSubmission(Job(self.record))


def last_step(run_dir: Path) -> int | None:
    last = run_dir / "checkpoints" / "last.ckpt"
    return torch.load(last, map_location="cpu", weights_only=True)["global_step"] if last.exists() else None


def mlflow_view(spec: dict, name: str) -> dict:
    """Rank 0: the trial's MLflow runs, their status and how often each step's train/loss was logged."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{spec['root']}/mlruns/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    counts: dict[int, int] = {}
    for m in client.get_metric_history(runs[0].info.run_id, "train/loss"):
        counts[m.step] = counts.get(m.step, 0) + 1
    evals = client.get_metric_history(runs[0].info.run_id, "eval/0shot/t6_next_line/acc")
    return {
        "runs": len(runs),
        "status": runs[0].info.status,
        "loss_steps": counts,
        "eval_steps": [m.step for m in evals],
    }


def run_trial(spec: dict, trial: dict) -> dict:
    rank = int(os.environ["RANK"])
    run_dir = Path(spec["root"]) / trial["name"]
    landed = run_dir / f"landed{rank}.json"
    out: dict = {"trial": trial["name"], "rank": rank}
    faulthandler.dump_traceback_later(spec["trial_timeout_s"], exit=True)
    try:
        if trial["events"]:
            if trial.get("submitit"):
                submitit_handlers(Path(spec["root"]), rank, spec["world"], run_dir / f"requeue{rank}.json")
            cfg = config(spec, trial, run_dir)
            with open_dict(cfg):
                cfg.callbacks.fault = {
                    "_target_": "fault_worker.FaultInjector",
                    "events": trial["events"],
                    "record": str(landed),
                    "eval_every": EVAL_EVERY if trial["eval"] else None,
                }
            out["interrupted"] = stop_and_hand_over(cfg)
            done = (
                json.loads((run_dir / f"loss{rank}.json").read_text())
                if (run_dir / f"loss{rank}.json").exists()
                else {}
            )
            out["interrupted"]["last_step"] = max((int(k) for k in done), default=0)
            out["landed"] = json.loads(landed.read_text()) if landed.exists() else []
            out["last_ckpt_step"] = last_step(run_dir)
            requeue = run_dir / f"requeue{rank}.json"
            out["requeue"] = json.loads(requeue.read_text()) if requeue.exists() else None
            for signum in (signal.SIGTERM, signal.SIGCONT, signal.SIGUSR1, signal.SIGUSR2):  # as before the trial
                signal.signal(signum, signal.SIG_DFL)  # (hand_over ignores them for the rest of a process's life)
            signal.signal(signal.SIGINT, signal.default_int_handler)
        out["resumed"] = stop_and_hand_over(config(spec, trial, run_dir, "auto_resume=true"))
        out["loss"] = json.loads((run_dir / f"loss{rank}.json").read_text())
        if rank == 0:
            out["mlflow"] = mlflow_view(spec, trial["name"])
    finally:
        faulthandler.cancel_dump_traceback_later()
    return out


def main(spec_path: str) -> None:
    import t6.run.execute

    spec = json.loads(Path(spec_path).read_text())
    t6.run.execute.destroy_process_group = lambda: None  # the trials of this process share one process group
    rank = int(os.environ["RANK"])
    results = []
    for trial in spec["trials"]:
        results.append(run_trial(spec, trial))
        Path(spec["root"], f"rank{rank}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
