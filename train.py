"""Train a T6: `python train.py attention=tpa size=tiny` (see conf/train.yaml for every group)."""

import os
import pickle
import signal
import sys
from pathlib import Path

os.environ.setdefault("T6_ROOT", str(Path(__file__).resolve().parent))

from t6.training.quiet import quiet_progress_bars  # noqa: E402

quiet_progress_bars()  # before anything imports tqdm

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from t6.config import in_multirun  # noqa: E402  (importing t6.config registers the config resolvers)
from t6.data.shards import ShardError  # noqa: E402
from t6.hardware.probes import env_rank  # noqa: E402
from t6.run.cli import UserError, discard_unused_run_dir, entry, print_config_tree  # noqa: E402
from t6.run.launch import hydra_job_scope  # noqa: E402
from t6.training.quiet import quiet_libraries  # noqa: E402

# What a plan raises for a problem the user can fix: a setting, a missing or damaged file, an unreachable
# store, a batch that cannot fit.
PLAN_ERRORS = (ValueError, FileNotFoundError, ConnectionError, MemoryError, pickle.UnpicklingError, ShardError)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from t6.run.execute import execute
    from t6.run.plan import plan_run
    from t6.run.summary import closing_summary
    from t6.training.preemption import hand_over

    quiet_libraries()
    try:
        with hydra_job_scope():  # DDP ranks started by Lightning repeat this job, not the whole sweep
            try:
                plan = plan_run(cfg)
            except PLAN_ERRORS as err:
                raise UserError(str(err)) from err
            if (
                plan.cfg.get("print_config")
                and env_rank() == 0
                and (not in_multirun() or HydraConfig.get().job.num == 0)
            ):
                print_config_tree(plan.cfg)  # once per sweep: Hydra prints each later job's overrides
            metrics, objects = execute(plan)
    except Exception:  # failed before writing anything: no empty run folder left behind
        if env_rank() == 0:
            discard_unused_run_dir(HydraConfig.get().runtime.output_dir)
        raise
    except SIGTERMException as stop:  # a stop signal every rank agreed on: last.ckpt saved, the MLflow run KILLED
        signum = getattr(stop, "signum", signal.SIGTERM)
        what = "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"terminated ({signal.Signals(signum).name})"
        print(f"{what}: last.ckpt saved; run the same command again to resume", file=sys.stderr)
        hand_over(signum, getattr(stop, "cluster_environment", None))  # requeue (submitit, SLURM); exit 128 + signum
    if objects["trainer"].is_global_zero:
        print(closing_summary(metrics, objects))
    return metrics.get("val/loss")  # for Hydra sweepers that optimize a value


if __name__ == "__main__":
    entry(main)
