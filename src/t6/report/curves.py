"""Training curves on a tokens axis: the tokens one optimizer step consumes, and the mean ± std over
seeds of a logged metric at each step every run logged."""

from __future__ import annotations

import statistics

from t6.data.batching import sequences_per_step, world_size
from t6.report.runs import RunData

CURVES = {"train/loss": "Training loss", "val/loss": "Validation loss", "val/ppl": "Validation perplexity"}


def tokens_per_step(params: dict[str, str]) -> int:
    """Training tokens per optimizer step, from a run's logged params: the global batch
    (t6.data.batching.sequences_per_step) x data.seq_len. Raises KeyError naming what is missing."""

    def get(key: str) -> str | None:
        value = params.get(key)
        return None if value in (None, "None", "null", "") else value

    seq_len, global_batch, batch = get("data.seq_len"), get("data.global_batch_size"), get("data.batch_size")
    devices = get("trainer.devices")
    processes = world_size(int(devices), int(get("trainer.num_nodes") or 1)) if str(devices).isdigit() else None
    if seq_len is None or (batch is None and global_batch is None):
        raise KeyError(
            "cannot compute tokens per step: missing param "
            + ("data.seq_len" if seq_len is None else "data.batch_size or data.global_batch_size")
        )
    try:
        sequences = sequences_per_step(
            int(batch) if batch and batch.isdigit() else batch,
            None if global_batch is None else int(global_batch),
            processes,
        )
    except ValueError as err:
        raise KeyError(f"cannot compute tokens per step from the run's params: {err}") from None
    return sequences * int(seq_len)


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
