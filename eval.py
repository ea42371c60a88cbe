"""Evaluate a checkpoint downstream: `python eval.py ckpt_path=PATH [eval=paper] [run_id=train]`
(conf/evaluate.yaml)."""

import hydra

from t6.cli import entry


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
def main(cfg) -> float | None:
    from t6.evaluation.evaluate import main as run

    return run(cfg)


if __name__ == "__main__":
    entry(main)
