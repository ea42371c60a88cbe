"""report.md: the runs and their status, then the tables and figures of the rows, then what is missing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from t6.model.attention import REFERENCE
from t6.report.curves import CURVES
from t6.report.evals import eval_metrics
from t6.report.matched import is_matched, matched_section
from t6.report.plots import plot_curves
from t6.report.runs import RunData, group_label, group_runs, last_step
from t6.report.stats import RESOLVED_P
from t6.report.tables import difference_table, eval_table, quality_table, tradeoff_table


@dataclass
class Report:
    markdown: str
    files: list[Path]


def build_report(
    runs: list[RunData],
    out_dir: str | Path,
    title: str,
    group_by: tuple[str, ...] = ("attention.name",),
    decode: list[dict] | None = None,
    decode_source: str | None = None,
) -> Report:
    """Write report.md and the three curve figures into out_dir; return the Markdown and the files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    grouped = group_runs(runs, group_by)
    groups = grouped.groups
    parts = [f"# {title}", ""]

    parts += [
        "## Runs",
        "",
        "| run | id | group | seed | status | last step | val/loss | in tables |",
        "|---|---|---|---|---|---:|---:|---|",
    ]
    reasons = {run.run_id: why for run, why in grouped.excluded}
    row_of = {run.run_id: label for label, members in groups.items() for run in members}
    for run in runs:
        step = last_step(run)
        val = run.metrics.get("val/loss")
        parts.append(
            f"| {run.name} | {run.run_id[:8]} | {row_of.get(run.run_id) or group_label(run, group_by) or '–'} | "
            f"{run.param('seed') or '–'} | {run.status} | {step if step is not None else '–'} | "
            f"{f'{val:.4f}' if val is not None else '–'} | "
            f"{'no: ' + reasons[run.run_id] if run.run_id in reasons else 'yes'} |"
        )
    parts.append("")
    if grouped.notes:
        parts += ["Not pooled:", ""] + [f"- {note}" for note in grouped.notes] + [""]
    if not groups:
        parts += ["No finished run to report on.", ""]
        (out / "report.md").write_text("\n".join(parts))
        return Report("\n".join(parts), [out / "report.md"])

    missing: list[str] = []
    quality = quality_table(groups)
    missing += quality.missing
    parts += [f"## {quality.title}", "", quality.markdown(), ""]

    evals = {}
    shots = sorted({s for rs in groups.values() for r in rs for s in eval_metrics(r.metrics)})
    for s in shots:
        table = eval_table(groups, s)
        if table is not None:
            evals[s] = table
            missing += table.missing
            parts += [f"## {table.title}", "", table.markdown(), ""]
    if not shots:
        parts += ["## Downstream evaluation", "", "No eval/{n}shot/{task}/{metric} metrics in these runs.", ""]

    reference = REFERENCE if REFERENCE in groups else next(iter(groups))
    if len(groups) > 1:
        diffs, resolved = difference_table(groups, reference, sorted(evals))
        parts += [
            f"## Differences from {reference} that the seeds resolve",
            "",
            f"Mean minus {reference}'s mean (loss in nats, accuracies in points) and Welch's two-sided p-value over "
            f"the seeds; bold: p < {RESOLVED_P}. With 3 seeds a row needs a difference several times its seed "
            "spread to be resolved; the rest may be noise.",
            "",
            diffs,
            "",
            "Resolved: " + ("; ".join(resolved) if resolved else "none") + ".",
            "",
        ]

    trade, notes = tradeoff_table(groups, evals, decode)
    parts += ["## Memory and speed next to quality", ""]
    if decode_source:
        parts += [f"Decode tokens/s from `{decode_source}`.", ""]
    parts += [trade, ""] + [f"- {note}" for note in notes] + ([""] if notes else [])

    files = []
    if is_matched(runs):  # runs under several match criteria: a table per criterion, loss against KV cache
        lines, figures = matched_section(runs, out)
        parts += lines
        files += figures
    problems = []
    for key in CURVES:
        path = out / (key.replace("/", "_") + ".png")
        problems += [f"{key}: {p}" for p in plot_curves(groups, key, path)]
        files.append(path)
        parts += [f"## {CURVES[key]} vs tokens", "", f"![{key}]({path.name})", ""]
    if problems:
        parts += ["Not drawn:", ""] + [f"- {p}" for p in problems] + [""]

    if missing:
        parts += ["## Missing metrics (finished runs, left out of that cell)", ""] + [f"- {m}" for m in missing] + [""]
    parts += [
        "Tokens per step = global batch (data.global_batch_size, else data.batch_size × trainer.devices × "
        "trainer.num_nodes) × data.seq_len, from each run's params; a value logged at step s is placed at "
        "(s + 1) × tokens per step. Bold: best mean per column. ± is the sample standard deviation over seeds.",
        "",
    ]
    markdown = "\n".join(parts)
    (out / "report.md").write_text(markdown)
    return Report(markdown, [out / "report.md", *files])
