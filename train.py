"""Train a T6: `python train.py attention=tpa size=tiny` (see conf/train.yaml for every group)."""

import os
import sys
from pathlib import Path

os.environ.setdefault("T6_ROOT", str(Path(__file__).resolve().parent))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import t6.config  # noqa: E402,F401  (registers the config resolvers)
from t6.distributed import hydra_job_scope  # noqa: E402
from t6.train import summary, train  # noqa: E402

PREEMPTED_EXIT = 143  # 128 + SIGTERM: the status schedulers and torchrun expect of a terminated job


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    try:
        with hydra_job_scope():  # DDP ranks started by Lightning repeat this job, not the whole sweep
            metrics, objects = train(cfg)
    except SIGTERMException:
        print("terminated (SIGTERM): last.ckpt saved; run the same command again to resume", file=sys.stderr)
        sys.exit(PREEMPTED_EXIT)
    if objects["trainer"].is_global_zero:
        print(summary(metrics, objects))
    return metrics.get("val/loss")  # for Hydra sweepers that optimize a value


if __name__ == "__main__":
    main()
