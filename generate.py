"""Generate text from a checkpoint: `python generate.py ckpt_path=... prompt="ROMEO:" max_new_tokens=100`
(see conf/generate.yaml for every setting)."""

import hydra
from omegaconf import DictConfig

from t6.inference.generate import run
from t6.run.cli import entry, register


@hydra.main(version_base="1.3", config_path="conf", config_name="generate")
def main(cfg: DictConfig) -> None:
    for text in run(cfg):
        print(text)
        print("-" * 40)


if __name__ == "__main__":
    register()  # t6's resolvers and each mechanism's options, before Hydra composes
    entry(main)  # a mistake in the config or on the command line: one message, exit 2
