"""Prepare token shards: `python prepare.py dataset=fineweb_edu` (conf/prepare.yaml, conf/dataset/)."""

import hydra

from t6.cli import entry


@hydra.main(version_base="1.3", config_path="conf", config_name="prepare")
def main(cfg):
    from t6.data.prepare import main as run

    return run(cfg)


if __name__ == "__main__":
    entry(main)
