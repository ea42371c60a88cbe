"""Export a checkpoint as a Hugging Face model directory (conf/export.yaml):
`python export.py ckpt_path=logs/train/runs/<time>/checkpoints/last.ckpt out=/tmp/t6-tiny`, then
`AutoModelForCausalLM.from_pretrained("/tmp/t6-tiny", trust_remote_code=True)`."""

import hydra

from t6.cli import entry


@hydra.main(version_base="1.3", config_path="conf", config_name="export")
def main(cfg) -> None:
    from t6.hf.export import main as run

    return run(cfg)


if __name__ == "__main__":
    entry(main)
