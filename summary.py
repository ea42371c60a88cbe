"""Print what a T6 costs without training: `python summary.py attention=tpa size=medium [output=json]`.

`python summary.py -m attention=mha,mqa,gqa,mla,tpa_kvonly,tpa size=medium` prints the comparison.
"""

import hydra
from omegaconf import DictConfig

import t6.config  # noqa: F401  (registers the config resolvers)
from t6.config import model_config
from t6.summary import render, summarize


@hydra.main(version_base="1.3", config_path="conf", config_name="summary")
def main(cfg: DictConfig) -> None:
    row = summarize(model_config(cfg), cfg.attention.name, cfg.size.name, cfg.cache_dtype, cfg.flops_seq_len)
    print(render(row, cfg.output), flush=True)
    if cfg.output == "table":
        print()


if __name__ == "__main__":
    main()
