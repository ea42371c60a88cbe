"""The tables of experiments/faults/README.md, from the records the fault suite and the SIGTERM measurement wrote:

T6_FAULTS_OUT=experiments/faults python -m pytest tests/test_faults.py     # -> trials.json
python experiments/faults/sigterm_all_ranks.py --out experiments/faults/sigterm_after.json
python experiments/faults/report.py                                         # prints the tables
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent


def cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1e}" if 0 < abs(value) < 1e-3 else f"{value:g}"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items())
    return str(value)


def trials_table(records: list[dict]) -> str:
    columns = [
        ("trial", "trial"),
        ("world", "ranks"),
        ("signals", "signal per rank"),
        ("landed", "landed during"),
        ("agreed", "agreed"),
        ("stop_step", "stop step"),
        ("checkpoint_step", "checkpoint step"),
        ("steps_lost", "steps lost"),
        ("exit_codes", "exit codes"),
        ("max_rel_loss_delta", "max rel. loss delta"),
        ("mlflow_runs", "MLflow runs"),
        ("stop_s", "s to stop"),
        ("hung", "hung"),
    ]
    lines = ["| " + " | ".join(title for _, title in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(key)) for key, _ in columns) + " |" for r in records]
    return "\n".join(lines)


def summary(records: list[dict]) -> str:
    seeded = [r for r in records if r["trial"].startswith("w")]
    two, four = (sum(r["world"] == world for r in seeded) for world in (2, 4))
    phases = Counter(p for r in seeded for p in r["landed"])
    signals = Counter(s for r in seeded for s in r["signals"].values())
    hung, runs = sum(r["hung"] for r in records), sorted({r["mlflow_runs"] for r in records})
    return (
        f"{len(records)} trials ({len(seeded)} seeded signal trials: {two} on 2 ranks, {four} on 4); hung {hung}, "
        f"MLflow runs per trial {runs}; signals landed during "
        + ", ".join(f"{k} {v}" for k, v in sorted(phases.items()))
        + "; the signals that landed: "
        + ", ".join(f"{k} {v}" for k, v in sorted(signals.items()))
    )


def sigterm_table(runs: dict[str, dict]) -> str:
    lines = [
        "| code | trials | hung (no exit within the timeout) | last.ckpt saved at the stop | worker exit codes "
        "| seconds to exit |",
        "|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        exits = [r["exit_s"] for r in run["results"] if r["exit_s"] is not None]
        codes = sorted({c for r in run["results"] for c in (r.get("worker_codes") or [])})
        span = f"{min(exits)}-{max(exits)}" if exits else "-"
        lines.append(
            f"| {name} ({run['commit']}) | {run['trials']} | {run['hung']} | {run['saved_on_stop']} | "
            f"{cell(codes) if codes else '-'} | {span} |"
        )
    return "\n".join(lines)


def main() -> None:
    records = json.loads((HERE / "trials.json").read_text())
    print(summary(records) + "\n")
    print(trials_table(records) + "\n")
    runs = {name: json.loads((HERE / f"sigterm_{name}.json").read_text()) for name in ("before", "after")}
    print(sigterm_table(runs))


if __name__ == "__main__":
    main()
