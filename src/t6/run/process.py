"""What a run changes for its whole process, each set here alone, for as long as it applies, then restored:

- `hydra_job_scope()`: Lightning's `ddp` strategy starts ranks 1..N-1 by re-running the entry script with
  `sys.argv`. Inside a Hydra multirun (`-m`), `sys.argv` is the whole sweep, so every child would start the sweep
  again. For the duration of one job this points the argv (and Hydra's run dir, which Lightning passes on) at that
  job alone: the children run `train.py <this job's overrides> hydra.run.dir=<this job's dir>`. Afterwards it
  restores the argv and the rendezvous variables Lightning put into the environment, so the next job of the sweep
  launches its own process group.
- `run_settings(plan)`, around execute: TF32 for the fp32 matmuls left outside autocast on CUDA, MLflow's HTTP
  client failing a request fast (no retries of its own, a 10 s timeout: the run's outbox retries, t6.tracking.outbox),
  and torch.compile's caches in the project's folder when the run compiles (t6.hardware.compile_cache).
- `run_directory(path)`, around execute, and `RunLock`, Hydra's callback, before Hydra writes into the directory:
  the run directory, held by this run alone (a lock file, released when the process ends however it ends); a
  second run started in it names the first and stops (exit 2), changing nothing there.
- `destroy_process_group()`: a sweep's next job in this process starts its own group.

Two settings live with the code they serve, scoped the same way: the stop signals' handlers, installed for the
fit only (t6.training.stop), and dynamo's recompile limit, lifted while a decoder steps (t6.model.static_decode).
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from t6.hardware.compile_cache import compile_cache
from t6.hardware.probes import env_rank, restored_environ

RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "PL_GLOBAL_SEED")
# MLflow's client retries a failed request up to 7 times over minutes; the outbox retries on its own (an
# environment that sets these already wins).
MLFLOW_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


@contextmanager
def environment(values: dict[str, str | None]) -> Iterator[None]:
    """os.environ with `values` where the environment does not set them already; as it was afterwards (the keys of
    `values`: also those set meanwhile, e.g. Lightning's rendezvous variables)."""
    with restored_environ(values):
        for key, value in values.items():
            if value is not None:
                os.environ.setdefault(key, value)
        yield


@contextmanager
def run_settings(plan) -> Iterator[None]:
    """A training run's process-wide settings (see the module docstring)."""
    import torch

    precision = torch.get_float32_matmul_precision()
    if plan.hardware.device == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 (A100 and later)
    cache = plan.hardware.compile_cache
    try:
        with environment(MLFLOW_HTTP), compile_cache(cache.path if cache is not None else None):
            yield
    finally:
        torch.set_float32_matmul_precision(precision)


@contextmanager
def hydra_job_scope() -> Iterator[None]:
    """Run one Hydra job so that Lightning's re-launched DDP ranks repeat this job, not the sweep."""
    from t6.hydra_config import in_multirun

    if not in_multirun():
        yield
        return
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import read_write

    hydra_cfg = HydraConfig.get()
    saved_argv, saved_run_dir = sys.argv[:], hydra_cfg.run.dir
    sys.argv = [sys.argv[0], *hydra_cfg.overrides.task]
    with read_write(hydra_cfg):
        hydra_cfg.run.dir = hydra_cfg.runtime.output_dir
    try:
        with environment(dict.fromkeys(RENDEZVOUS_ENV)):  # none set: only restored as they were
            yield
    finally:
        sys.argv = saved_argv
        with read_write(hydra_cfg):
            hydra_cfg.run.dir = saved_run_dir


LOCK = ".run.lock"
HELD: dict[Path, object] = {}  # the run directories this process holds: their open lock files


def hold(path: str | Path) -> None:
    """Take the run directory `path` for this process (an exclusive lock on `<path>/.run.lock`, which names the run
    holding it; released when the process ends, however it ends). Held by another process: a UserError naming it,
    the directory unchanged. Held by this one already: nothing to do."""
    from t6.errors import UserError

    path = Path(path).absolute()
    if path in HELD:
        return
    path.mkdir(parents=True, exist_ok=True)
    file = open(path / LOCK, "a+", encoding="utf-8")
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        holder = file.read().strip() or "another run"
        file.close()
        raise UserError(
            f"{path} is the run directory of a run still going ({holder}); wait for it to end or stop it, or give "
            "this run a directory of its own (hydra.run.dir=..., or leave it to Hydra's timestamp)"
        ) from None
    file.seek(0)
    file.truncate()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    file.write(f"pid {os.getpid()} on {socket.gethostname()}, started {started}: {' '.join(sys.argv)}\n")
    file.flush()
    HELD[path] = file


def release(path: str | Path) -> None:
    file = HELD.pop(Path(path).absolute(), None)
    if file is not None:
        fcntl.flock(file, fcntl.LOCK_UN)
        file.close()


@contextmanager
def run_directory(path: str | Path, rank: int = 0) -> Iterator[None]:
    """Hold the run directory `path` for this run (`hold`) while it lasts: rank 0 holds it (the other ranks are the
    same run). A directory `RunLock` took before Hydra wrote into it stays held by this process afterwards, for
    its job's end."""
    if rank != 0:
        yield
        return
    taken = Path(path).absolute() not in HELD
    hold(path)
    try:
        yield
    finally:
        if taken:
            release(path)


class RunLock(Callback):
    """Hydra callback (conf/hydra/default.yaml, the first of them): hold the run directory (a sweep's directory
    under -m) before Hydra writes anything into it (its .hydra/ config, the job's log file, the sweep's MLflow
    file), so a second run started in a directory a run still holds stops (exit 2) and changes nothing there.
    Hydra only warns about an Exception of a callback, so the refusal leaves as a UserExit. The ranks a DDP run
    re-launches (LOCAL_RANK set) are that run: they take nothing."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        self.take(config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self.take(config.hydra.sweep.dir)

    @staticmethod
    def take(path: str) -> None:
        from t6.errors import UserError, UserExit

        if env_rank() != 0:
            return
        try:
            hold(path)
        except UserError as err:
            raise UserExit(err) from None


def destroy_process_group() -> None:
    """End this process's torch.distributed group (a sweep's next job starts a new one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
