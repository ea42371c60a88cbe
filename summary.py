"""Print what a T6 costs without training: `python summary.py attention=tpa size=medium [output=json]`.

`python summary.py -m attention=mha,mqa,gqa,mla,tpa_kvonly,tpa size=medium` prints the comparison as one table
(output=json: one JSON line per job).
"""

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from t6.config import model_config
from t6.report.summary import render, summarize
from t6.run.cli import entry, register


@hydra.main(version_base="1.3", config_path="conf", config_name="summary")
def main(cfg: DictConfig) -> dict:
    row = summarize(model_config(cfg), cfg.attention.name, cfg.size.name, cfg.cache_dtype, cfg.flops_seq_len)
    if cfg.output == "table" and HydraConfig.get().mode == RunMode.MULTIRUN:
        return row  # t6.report.summary.ComparisonTable prints every job's row as one table at the end
    print(render(row, cfg.output), flush=True)
    return row


if __name__ == "__main__":
    register()  # t6's resolvers and each mechanism's options, before Hydra composes
    entry(main)  # a mistake in the config or on the command line: one message, exit 2
