"""The sizes the match group solves for the study's mechanisms, and what each model costs: query heads, the sizes
that moved, parameters, KV bytes per token and training FLOPs per token, at each size (tiny: the CPU study; small,
medium: its GPU recipe), and the GPU hours of the recipe's runs from those FLOPs.

    python experiments/matched/sizes.py            # writes sizes.json here, prints the tables
    python -m t6.report.experiments                # renders them into README.md

Nothing is trained: every number is the model's, built on the meta device (t6.model.match, t6.model.facts).
"""

from __future__ import annotations

import json
import platform
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
MECHANISMS = ["mha", "mqa", "gqa", "mla", "tpa_kvonly", "tpa", "gta", "gla", "diff"]
GATED = ["mha", "tpa"]  # with attention.options.output_gate=elementwise
CRITERIA = ["params", "heads", "kv_bytes"]
SIZES = ["tiny", "small", "medium"]


def solve(name: str, size: str, criterion: str, gated: bool) -> dict:
    from t6.bench.common import compose
    from t6.hydra_config import with_match

    overrides = [f"attention={name}", f"size={size}", f"match={criterion}"]
    overrides += ["attention.options.output_gate=elementwise"] if gated else []
    _, m = with_match(compose("train", overrides, runtime=True))
    q = m.quantities(m.model)
    return {
        "attention": name + ("+gate" if gated else ""),
        "size": size,
        "criterion": criterion,
        "n_head": m.model.n_head,
        "changed": {k: list(v) for k, v in m.changes().items()},
        "params": q["params"],
        "kv_bytes_per_token": q["kv_bytes"],
        "train_flops_per_token": q["flops"],
        "gap": m.gap(),
    }


def main() -> None:
    import torch

    rows = [
        solve(name, size, criterion, gated)
        for size in SIZES
        for criterion in CRITERIA
        for name, gated in [(n, False) for n in MECHANISMS] + [(n, True) for n in GATED]
    ]
    payload = {
        "benchmark": "matched_sizes",
        "environment": {"python": platform.python_version(), "torch": torch.__version__, "date": str(date.today())},
        "records": rows,
    }
    (HERE / "sizes.json").write_text(json.dumps(payload, indent=1) + "\n")
    from t6.report.experiments import matched_sizes_table

    print(matched_sizes_table(payload))


if __name__ == "__main__":
    main()
