"""Evaluate a checkpoint downstream (conf/evaluate.yaml):
`python eval.py ckpt_path=PATH [eval=paper] [run_id=train]`."""

import os
from pathlib import Path

os.environ.setdefault("T6_ROOT", str(Path(__file__).resolve().parent))

from t6.training.quiet import quiet_progress_bars  # noqa: E402

quiet_progress_bars()  # before anything imports tqdm

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from t6.run.cli import entry, register, user_errors  # noqa: E402


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
def main(cfg: DictConfig) -> float | None:
    from t6.evaluation.checkpoint import evaluate, prepare_evaluation

    with user_errors():  # a missing or damaged checkpoint, an unreachable store, an unknown task or run
        prepared = prepare_evaluation(cfg)
    metrics, run_id = evaluate(prepared, cfg.eval)
    for name, value in metrics.items():
        if "stderr" not in name:
            print(f"{name:48s} {value:.4f}")
    print(f"MLflow run {run_id}")
    return next((v for k, v in metrics.items() if k.endswith("/avg")), None)


if __name__ == "__main__":
    register()  # t6's resolvers and each mechanism's options, before Hydra composes
    entry(main)  # a mistake in the config, on the command line or in a file: one message, exit 2
