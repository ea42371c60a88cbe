"""Launching under Hydra and Lightning (no process management of our own).

- `hydra_job_scope()`: Lightning's `ddp` strategy starts ranks 1..N-1 by re-running the entry
  script with `sys.argv`. Inside a Hydra multirun (`-m`), `sys.argv` is the whole sweep, so
  every child would start the sweep again. For the duration of one job this points the argv
  (and Hydra's run dir, which Lightning passes on) at that job alone: the children run
  `train.py <this job's overrides> hydra.run.dir=<this job's dir>`. Afterwards it restores
  the argv and the rendezvous variables Lightning put into the environment, so the next job
  of the sweep launches its own process group.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "PL_GLOBAL_SEED")


@contextmanager
def hydra_job_scope() -> Iterator[None]:
    """Run one Hydra job so that Lightning's re-launched DDP ranks repeat this job, not the sweep."""
    from t6.config import in_multirun

    if not in_multirun():
        yield
        return
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import read_write

    hydra_cfg = HydraConfig.get()
    saved_argv, saved_env = sys.argv[:], {k: os.environ.get(k) for k in RENDEZVOUS_ENV}
    saved_run_dir = hydra_cfg.run.dir
    sys.argv = [sys.argv[0], *hydra_cfg.overrides.task]
    with read_write(hydra_cfg):
        hydra_cfg.run.dir = hydra_cfg.runtime.output_dir
    try:
        yield
    finally:
        sys.argv = saved_argv
        with read_write(hydra_cfg):
            hydra_cfg.run.dir = saved_run_dir
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def destroy_process_group() -> None:
    """End this process's torch.distributed group (a sweep's next job starts a new one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
