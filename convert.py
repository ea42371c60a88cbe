"""Convert a model's attention into any registered mechanism for uptraining (conf/convert.yaml):
`python convert.py ckpt_path=SOURCE target=mla +options.kv_lora_rank=96 distill_steps=200 out=ckpt/mla.ckpt`."""

import os
from pathlib import Path

os.environ.setdefault("T6_ROOT", str(Path(__file__).resolve().parent))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from t6.run.cli import entry, register, user_errors  # noqa: E402


@hydra.main(version_base="1.3", config_path="conf", config_name="convert")
def main(cfg: DictConfig) -> None:
    from t6.uptrain.job import run

    with user_errors():  # a setting or a source to fix: said without a traceback
        lines = run(cfg)
    for line in lines:
        print(line)


if __name__ == "__main__":
    register()  # t6's resolvers and each mechanism's options, before Hydra composes
    entry(main)  # a mistake in the config or on the command line: one message, exit 2
