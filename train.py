"""Train a T6: `python train.py attention=tpa size=tiny` (conf/train.yaml lists every group; --help shows them)."""

import hydra

from t6.cli import entry


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg) -> float | None:
    from t6.run.train import main as run

    metrics, _ = run(cfg)
    return metrics.get("val/loss")  # for Hydra sweepers that optimize a value


if __name__ == "__main__":
    entry(main)
