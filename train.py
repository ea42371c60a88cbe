"""Train a T6: `python train.py attention=tpa size=tiny` (see conf/train.yaml for every group)."""

import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("T6_ROOT", str(Path(__file__).resolve().parent))

from t6.training.quiet import quiet_progress_bars  # noqa: E402

quiet_progress_bars()  # before anything imports tqdm

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from t6.config import in_multirun  # noqa: E402
from t6.hardware.probes import env_rank  # noqa: E402
from t6.run.cli import discard_unused_run_dir, entry, print_config_tree, register, user_errors  # noqa: E402
from t6.run.process import hydra_job_scope  # noqa: E402
from t6.training.quiet import quiet_libraries  # noqa: E402


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from t6.run.execute import execute
    from t6.run.plan import plan_run
    from t6.run.summary import closing_summary
    from t6.training.stop import RunStopped, hand_over

    quiet_libraries()
    try:
        with hydra_job_scope():  # DDP ranks started by Lightning repeat this job, not the whole sweep
            with user_errors():  # a setting, a missing or damaged file, an unreachable store, a batch too large
                plan = plan_run(cfg)
            if cfg.get("print_config") and env_rank() == 0 and (not in_multirun() or HydraConfig.get().job.num == 0):
                print_config_tree(plan.cfg)  # once per sweep: Hydra prints each later job's overrides
            metrics, objects = execute(plan)
    except Exception:  # failed before writing anything: no empty run folder left behind
        if env_rank() == 0:
            discard_unused_run_dir(HydraConfig.get().runtime.output_dir)
        raise
    except RunStopped as stop:  # a stop signal every rank agreed on: last.ckpt saved, the MLflow run KILLED
        name = signal.Signals(stop.signum).name
        what = "interrupted (Ctrl-C)" if stop.signum == signal.SIGINT else f"terminated ({name})"
        saved = f"{Path(stop.path).name} saved at step {stop.step}"
        print(f"{what}: {saved}; run the same command again to resume", file=sys.stderr)
        hand_over(stop.signum, stop.cluster_environment)  # requeue (submitit, SLURM); exit 128 + signum
    if objects["trainer"].is_global_zero:
        print(closing_summary(metrics, objects))
    return metrics.get("val/loss")  # for Hydra sweepers that optimize a value


if __name__ == "__main__":
    register()  # t6's resolvers and each mechanism's options, before Hydra composes
    entry(main)  # a mistake in the config or on the command line: one message, exit 2
