"""The report's tables: final losses, one downstream-evaluation table per number of shots, and
parameters / KV cache / decode speed next to quality; each as Markdown with the best mean per column in bold."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from t6.report.evals import eval_metrics, task_metric, task_order
from t6.report.model_facts import logged_fact, model_stats_from_params
from t6.report.runs import RunData, attention_of
from t6.report.stats import Cell, aggregate, best_rows, difference

QUALITY = ("train/loss", "val/loss", "val/ppl")  # lower is better
SHOT_NAMES = {0: "Zero-shot", 1: "One-shot", 2: "Two-shot"}


@dataclass
class Table:
    title: str
    columns: list[str]  # header texts, after the row label
    rows: dict[str, list[Cell]]
    higher_is_better: list[bool]
    scale: float = 1.0
    digits: int = 2
    missing: list[str] = field(default_factory=list)  # "run (id): metric" entries

    def markdown(self, row_header: str = "attention") -> str:
        best = [
            best_rows({r: cells[i] for r, cells in self.rows.items()}, hib)
            for i, hib in enumerate(self.higher_is_better)
        ]
        lines = [f"| {row_header} | " + " | ".join(self.columns) + " |", "|---|" + "---:|" * len(self.columns)]
        for row, cells in self.rows.items():
            texts = []
            for i, cell in enumerate(cells):
                text = cell.format(self.scale, self.digits)
                texts.append(f"**{text}**" if row in best[i] else text)
            lines.append(f"| {row} | " + " | ".join(texts) + " |")
        return "\n".join(lines)


def eval_table(groups: dict[str, list[RunData]], shots: int) -> Table | None:
    """One row per group, one column per task (with its metric), and the average of the columns.

    A run's average is the mean of its task columns, computed only when it has all of them."""
    values = eval_values(groups, shots)
    if values is None:
        return None
    by_group, columns, missing = values
    rows = {label: [aggregate(by_group[label][c], len(runs)) for c in columns] for label, runs in groups.items()}
    title = (
        f"{SHOT_NAMES.get(shots, f'{shots}-shot')} evaluation (accuracy %, mean ± std over seeds; "
        "metric per task in its header; Avg. = mean of the task columns per run)"
    )
    return Table(title, columns, rows, [True] * len(columns), scale=100.0, digits=2, missing=missing)


def eval_values(groups: dict[str, list[RunData]], shots: int):
    """The runs' values per group and column, the columns ("task (metric)" per task, then "Avg."), and the
    missing entries; None when no run logged a downstream metric at this number of shots."""
    per_run = {run.run_id: eval_metrics(run.metrics).get(shots, {}) for runs in groups.values() for run in runs}
    logged: dict[str, set[str]] = defaultdict(set)
    for tasks in per_run.values():
        for task, metrics in tasks.items():
            logged[task] |= set(metrics)
    if not logged:
        return None
    tasks = [(task, task_metric(task, logged[task])) for task in task_order(logged)]
    tasks = [(t, m) for t, m in tasks if m is not None]
    columns = [f"{task} ({metric})" for task, metric in tasks] + ["Avg."]
    by_group: dict[str, dict[str, list[float]]] = {}
    missing = []
    for label, runs in groups.items():
        by_group[label] = per_column = defaultdict(list)
        for run in runs:
            values = []
            for (task, metric), column in zip(tasks, columns):
                value = per_run[run.run_id].get(task, {}).get(metric)
                if value is None or not math.isfinite(value):
                    missing.append(f"{run.name} ({run.run_id[:8]}): eval/{shots}shot/{task}/{metric}")
                else:
                    per_column[column].append(value)
                    values.append(value)
            if len(values) == len(tasks):
                per_column["Avg."].append(statistics.fmean(values))
    return by_group, columns, missing


def difference_table(groups: dict[str, list[RunData]], reference: str, shots: list[int]) -> tuple[str, list[str]]:
    """Each group's difference from the reference group in val/loss and in every downstream column, with
    Welch's p-value over the seeds (Markdown, the differences resolved at p < RESOLVED_P)."""
    loss = {label: [r.metrics["val/loss"] for r in runs if "val/loss" in r.metrics] for label, runs in groups.items()}
    columns: list[tuple[str, dict[str, list[float]]]] = [("val/loss", loss)]
    for s in shots:
        values = eval_values(groups, s)
        if values is not None:
            by_group, names, _ = values
            columns += [(f"{s}-shot {name}", {label: by_group[label][name] for label in groups}) for name in names]
    lines = ["| attention | " + " | ".join(f"Δ {name}" for name, _ in columns) + " |", "|---|" + "---:|" * len(columns)]
    resolved = []
    for label in groups:
        if label == reference:
            continue
        cells = []
        for name, values in columns:
            diff = difference(values[label], values[reference])
            if diff is None:
                cells.append("–")
                continue
            text = diff.format(1.0, 3) if name == "val/loss" else diff.format(100.0, 2)  # nats; points
            cells.append(f"**{text}**" if diff.resolved else text)
            if diff.resolved:
                resolved.append(f"{label} {name} {text}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines), resolved


def quality_table(groups: dict[str, list[RunData]]) -> Table:
    rows, missing = {}, []
    for label, runs in groups.items():
        cells = []
        for key in QUALITY:
            values = [r.metrics[key] for r in runs if key in r.metrics]
            missing += [f"{r.name} ({r.run_id[:8]}): {key}" for r in runs if key not in r.metrics]
            cells.append(aggregate(values, len(runs)))
        rows[label] = cells
    return Table(
        "Final losses (mean ± std over seeds; lower is better)",
        list(QUALITY),
        rows,
        [False] * len(QUALITY),
        digits=4,
        missing=missing,
    )


def tradeoff_table(
    groups: dict[str, list[RunData]], evals: dict[int, Table], decode: list[dict] | None = None
) -> tuple[str, list[str]]:
    """Parameters, KV cache per token and decode tokens/s next to the quality numbers (Markdown, notes)."""
    notes, computed = [], set()
    contexts = sorted({int(r["context"]) for r in decode or []})
    header = ["params", "KV cache / token"] + [f"decode tok/s @ {c}" for c in contexts] + ["val/loss", "val/ppl"]
    header += [f"{SHOT_NAMES.get(s, f'{s}-shot')} avg. (%)" for s in sorted(evals)]
    quality = quality_table(groups)
    lines = ["| attention | " + " | ".join(header) + " |", "|---|" + "---:|" * len(header)]
    for label, runs in groups.items():
        run = runs[0]
        params, kv = logged_fact(run, "model/params"), logged_fact(run, "model/kv_cache_bytes_per_token")
        if params is None or kv is None:
            try:
                stats = model_stats_from_params(run.params)
            except (KeyError, ValueError) as err:
                notes.append(f"{label}: parameters/KV cache unknown ({err})")
                stats = {}
            if params is None and "params" in stats:
                params = stats["params"]
                computed.add(label)
            if kv is None and "kv_cache_bytes_per_token" in stats:
                kv = stats["kv_cache_bytes_per_token"]
                computed.add(label)
        attention = attention_of(run) or label
        cells = [f"{params / 1e6:.2f}M" if params is not None else "–", _bytes(kv) if kv is not None else "–"]
        for context in contexts:
            speeds = [
                float(r["tokens_per_s"]) for r in decode if r["attention"] == attention and int(r["context"]) == context
            ]
            cells.append(f"{statistics.fmean(speeds):.1f}" if speeds else "–")
        cells += [quality.rows[label][1].format(digits=4), quality.rows[label][2].format(digits=2)]
        cells += [evals[s].rows[label][-1].format(100.0, 2) for s in sorted(evals)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if computed:
        notes.append(
            "parameters / KV cache of " + ", ".join(sorted(computed)) + " computed from the run's config "
            "(model built on the meta device; KV cache at 2 bytes per element, all layers)"
        )
    return "\n".join(lines), notes


def _bytes(n: float) -> str:
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n:.0f} B"
