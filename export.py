"""Export a checkpoint as a Hugging Face model directory (conf/export.yaml):
`python export.py ckpt_path=logs/train/runs/<time>/checkpoints/last.ckpt out=/tmp/t6-tiny`, then
`AutoModelForCausalLM.from_pretrained("/tmp/t6-tiny", trust_remote_code=True)`."""

import os
from pathlib import Path

os.environ.setdefault("T6_ROOT", str(Path(__file__).resolve().parent))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import t6.config  # noqa: E402,F401  (registers the config resolvers)
from t6.hf.export import run  # noqa: E402


@hydra.main(version_base="1.3", config_path="conf", config_name="export")
def main(cfg: DictConfig) -> None:
    for line in run(cfg):
        print(line)


if __name__ == "__main__":
    main()
