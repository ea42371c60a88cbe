"""Convert a model's attention into any registered mechanism for uptraining (conf/convert.yaml):
`python convert.py ckpt_path=SOURCE target=mla +options.kv_lora_rank=96 distill_steps=200 out=ckpt/mla.ckpt`."""

import os
from pathlib import Path

os.environ.setdefault("T6_ROOT", str(Path(__file__).resolve().parent))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import t6.config  # noqa: E402,F401  (registers the config resolvers)
from t6.run.cli import UserError, entry  # noqa: E402


@hydra.main(version_base="1.3", config_path="conf", config_name="convert")
def main(cfg: DictConfig) -> None:
    from t6.uptrain.cli import run

    try:
        lines = run(cfg)
    except (ValueError, FileNotFoundError) as err:  # a setting or a source to fix: said without a traceback
        raise UserError(str(err)) from err
    for line in lines:
        print(line)


if __name__ == "__main__":
    entry(main)
