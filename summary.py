"""Print what a T6 costs without training: `python summary.py attention=tpa size=medium [output=json]`.

`python summary.py -m attention=mha,mqa,gqa,mla,tpa_kvonly,tpa size=medium` prints the comparison as one table
(output=json: one JSON line per job)."""

import hydra

from t6.cli import entry


@hydra.main(version_base="1.3", config_path="conf", config_name="summary")
def main(cfg) -> dict:
    from t6.report.summary import main as run

    return run(cfg)


if __name__ == "__main__":
    entry(main)
