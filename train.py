"""Train a T6: `python train.py attention=tpa size=tiny` (see conf/train.yaml for every group)."""

import os
from pathlib import Path

os.environ.setdefault("T6_ROOT", str(Path(__file__).resolve().parent))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import t6.config  # noqa: E402,F401  (registers the config resolvers)
from t6.train import summary, train  # noqa: E402


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    metrics, objects = train(cfg)
    if objects["trainer"].is_global_zero:
        print(summary(metrics, objects))
    return metrics.get("val/loss")  # for Hydra sweepers that optimize a value


if __name__ == "__main__":
    main()
