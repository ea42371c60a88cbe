"""Export a checkpoint as a Hugging Face model directory (conf/export.yaml):
`python export.py ckpt_path=logs/train/runs/<time>/checkpoints/last.ckpt out=/tmp/t6-tiny`, then
`AutoModelForCausalLM.from_pretrained("/tmp/t6-tiny", trust_remote_code=True)`."""

import os
from pathlib import Path

os.environ.setdefault("T6_ROOT", str(Path(__file__).resolve().parent))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from t6.hf.export import run  # noqa: E402
from t6.run.cli import entry, register  # noqa: E402


@hydra.main(version_base="1.3", config_path="conf", config_name="export")
def main(cfg: DictConfig) -> None:
    for line in run(cfg):
        print(line)


if __name__ == "__main__":
    register()  # t6's resolvers and each mechanism's options, before Hydra composes
    entry(main)  # a mistake in the config or on the command line: one message, exit 2
