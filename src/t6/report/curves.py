"""Training curves on a tokens axis: the tokens one optimizer step consumes, and the mean ± std over
seeds of a logged metric at each step every run logged."""

from __future__ import annotations

import statistics

from t6.report.runs import RunData

CURVES = {"train/loss": "Training loss", "val/loss": "Validation loss", "val/ppl": "Validation perplexity"}


def tokens_per_step(params: dict[str, str]) -> int:
    """Training tokens per optimizer step: global batch (data.global_batch_size, else data.batch_size
    x trainer.devices x trainer.num_nodes) x data.seq_len. Raises KeyError naming the missing params."""

    def get(key: str) -> str | None:
        value = params.get(key)
        return None if value in (None, "None", "null", "") else value

    seq_len, global_batch = get("data.seq_len"), get("data.global_batch_size")
    missing = [] if seq_len else ["data.seq_len"]
    if global_batch is None:
        batch, devices = get("data.batch_size"), get("trainer.devices")
        if batch is None:
            missing.append("data.batch_size (or data.global_batch_size)")
        if devices is None or not str(devices).isdigit():
            missing.append(f"trainer.devices as a number (got {devices!r}; or data.global_batch_size)")
        if not missing:
            global_batch = int(batch) * int(devices) * int(get("trainer.num_nodes") or 1)
    if missing:
        raise KeyError("cannot compute tokens per step: missing params " + ", ".join(missing))
    return int(global_batch) * int(seq_len)


def curve(runs: list[RunData], key: str) -> tuple[list[float], list[float], list[float]] | None:
    """(tokens, mean, std) over the steps every run logged; a value logged at step s was seen
    after s+1 optimizer steps, i.e. at (s+1) x tokens_per_step tokens."""
    per_run = []
    for run in runs:
        tps = tokens_per_step(run.params)
        points = {}
        for step, value in run.history.get(key, []):
            points[(step + 1) * tps] = value  # a resumed run may log a step twice: the later value wins
        per_run.append(points)
    if not per_run or not all(per_run):
        return None
    common = sorted(set.intersection(*(set(p) for p in per_run)))
    means = [statistics.fmean(p[x] for p in per_run) for x in common]
    stds = [statistics.stdev([p[x] for p in per_run]) if len(per_run) > 1 else 0.0 for x in common]
    return [float(x) for x in common], means, stds
