"""Evaluate a checkpoint downstream (conf/evaluate.yaml):
`python eval.py ckpt_path=PATH [eval=paper] [run_id=train]`."""

import os
from pathlib import Path

os.environ.setdefault("T6_ROOT", str(Path(__file__).resolve().parent))

from t6.training.quiet import quiet_progress_bars  # noqa: E402

quiet_progress_bars()  # before anything imports tqdm

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from t6.evaluation.checkpoint import evaluate_checkpoint  # noqa: E402
from t6.run.cli import entry, register  # noqa: E402


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
def main(cfg: DictConfig) -> float | None:
    metrics, run_id = evaluate_checkpoint(cfg)
    for name, value in metrics.items():
        if "stderr" not in name:
            print(f"{name:48s} {value:.4f}")
    print(f"MLflow run {run_id}")
    return next((v for k, v in metrics.items() if k.endswith("/avg")), None)


if __name__ == "__main__":
    register()  # t6's resolvers and each mechanism's options, before Hydra composes
    entry(main)  # a mistake in the config or on the command line: one message, exit 2
