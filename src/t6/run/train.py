"""`main(cfg)`: everything `python train.py` does, the one way into a training run (train.py, the tests, the
fault-injection workers and the benchmarks call it):

1. within one Hydra job (t6.run.process.hydra_job_scope: Lightning's re-launched DDP ranks repeat this job, not
   the whole sweep), plan the run (t6.run.plan: every decision and check, nothing built), print the config
   (print_config=true) and carry the plan out (t6.run.execute);
2. a run that fails before it wrote anything leaves no empty run directory behind;
3. a stop signal every rank agreed on (last.ckpt saved, the MLflow run KILLED) is said in one line and handed to
   the signal's earlier owner: requeue (submitit, SLURM), exit 128 + signum;
4. rank 0 prints the closing summary.
"""

from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from t6.hardware.probes import env_rank
from t6.hydra_config import in_multirun
from t6.run.closing import closing_summary
from t6.run.execute import execute
from t6.run.plan import plan_run
from t6.run.process import HELD, LOCK, hydra_job_scope
from t6.training.stop import RunStopped, hand_over


def main(cfg: DictConfig) -> tuple[dict[str, float], dict[str, Any]]:
    """Train a T6 as configured. Returns (final metrics, the objects built: plan, model, datamodule, trainer, ...)."""
    try:
        with hydra_job_scope():
            plan = plan_run(cfg)
            if cfg.get("print_config") and env_rank() == 0 and first_job():
                print_config_tree(plan.cfg)
            metrics, objects = execute(plan)
    except RunStopped as stop:
        name = signal.Signals(stop.signum).name
        what = "interrupted (Ctrl-C)" if stop.signum == signal.SIGINT else f"terminated ({name})"
        print(f"{what}: {Path(stop.path).name} saved at step {stop.step}; run the same command again to resume",
              file=sys.stderr)  # fmt: skip
        hand_over(stop.signum, stop.cluster_environment)
        raise  # hand_over exits; here only where it returned
    except Exception:
        if env_rank() == 0:
            discard_unused_run_dir(OmegaConf.select(cfg, "paths.output_dir", default=None))
        raise
    if objects["trainer"].is_global_zero:
        print(closing_summary(metrics, objects))
    return metrics, objects


def first_job() -> bool:
    """Not a sweep, or its first job (Hydra prints each later job's overrides)."""
    from hydra.core.hydra_config import HydraConfig

    return not in_multirun() or HydraConfig.get().job.num == 0


HYDRA_ONLY = {".hydra", "train.log", LOCK}  # what a run writes into its directory at start (Hydra; the lock)


def discard_unused_run_dir(run_dir: str | Path | None) -> bool:
    """Remove a run directory this process holds (t6.run.process.HELD) with nothing in it but what a run writes at
    start (Hydra's .hydra/ and log, the run's lock): the trace of a run that failed on its config before doing
    anything. Returns whether it did."""
    if run_dir is None or Path(run_dir).absolute() not in HELD:
        return False  # another run's directory, or none
    path = Path(run_dir)
    if not path.is_dir() or not {p.name for p in path.iterdir()} <= HYDRA_ONLY:
        return False
    shutil.rmtree(path)
    return True


def print_config_tree(cfg: DictConfig) -> None:
    """The composed config as a tree (print_config=true; it is always in the run's .hydra/ and MLflow)."""
    import rich
    import rich.syntax
    import rich.tree

    tree = rich.tree.Tree("CONFIG", guide_style="dim")
    for key, value in cfg.items():
        branch = tree.add(str(key))
        text = OmegaConf.to_yaml(value, resolve=True) if isinstance(value, DictConfig) else str(value)
        branch.add(rich.syntax.Syntax(text, "yaml"))
    rich.print(tree)
