"""Convert a model's attention into any registered mechanism for uptraining (conf/convert.yaml):
`python convert.py ckpt_path=SOURCE target=mla +options.kv_lora_rank=96 distill_steps=200 out=ckpt/mla.ckpt`."""

import hydra

from t6.cli import entry


@hydra.main(version_base="1.3", config_path="conf", config_name="convert")
def main(cfg) -> None:
    from t6.uptrain.job import main as run

    return run(cfg)


if __name__ == "__main__":
    entry(main)
