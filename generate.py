"""Generate text from a checkpoint: `python generate.py ckpt_path=... prompt="ROMEO:" max_new_tokens=100`
(conf/generate.yaml lists every setting)."""

import hydra

from t6.cli import entry


@hydra.main(version_base="1.3", config_path="conf", config_name="generate")
def main(cfg) -> list[str]:
    from t6.inference.generate import main as run

    return run(cfg)


if __name__ == "__main__":
    entry(main)
