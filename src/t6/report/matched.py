"""The matched comparison (experiment=matched, the `match` group): one table per criterion and one figure.

Runs are grouped by their `match.name` (the criterion) and their mechanism (attention.name, with "+gate" where
attention.options.output_gate is set). Each table gives every mechanism's parameters, query heads and KV bytes
per token as matched, its validation loss as mean ± the 95% confidence interval over the seeds (Student's t),
its difference from the reference (MHA) under the same criterion and Welch's two-sided p-value. The figure puts
every row of every criterion at (KV bytes per token, validation loss) with the Pareto front: the rows no other
row beats on both (less cache and lower loss)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from scipy import stats as scipy_stats

from t6.model.attention import PAPER, REFERENCE
from t6.model.match import CRITERIA
from t6.report.model_facts import logged_fact
from t6.report.runs import RunData, attention_of
from t6.report.stats import RESOLVED_P, difference

LOSS = "val/loss"
CI_LEVEL = 0.95


def confidence_interval(values: list[float], level: float = CI_LEVEL) -> float | None:
    """Half-width of the two-sided `level` interval of the mean (Student's t, n - 1 degrees of freedom); None for
    fewer than two values."""
    if len(values) < 2:
        return None
    t = float(scipy_stats.t.ppf(0.5 + level / 2, len(values) - 1))
    return t * statistics.stdev(values) / math.sqrt(len(values))


def criterion_of(run: RunData) -> str | None:
    return run.param("match.name")


def mechanism_label(run: RunData) -> str | None:
    """The mechanism as the table names it: its attention, "+gate" with an elementwise output gate ("+gate(headwise)"
    with a headwise one)."""
    name = attention_of(run)
    gate = run.param("attention.options.output_gate") or "none"
    if name is None or gate == "none":
        return name
    return f"{name}+gate" if gate == "elementwise" else f"{name}+gate({gate})"


def is_matched(runs: list[RunData]) -> bool:
    """Whether the runs are a matched comparison: finished runs under more than one criterion."""
    return len({criterion_of(r) for r in runs if r.status == "FINISHED" and criterion_of(r)}) > 1


def rank(label: str) -> tuple:
    """The paper's six first, in its order, then the rest by name; a gated row after its mechanism."""
    base = label.split("+")[0]
    return (0, PAPER.index(base), label) if base in PAPER else (1, 0, label)


def rows_by_criterion(runs: list[RunData]) -> dict[str, dict[str, list[RunData]]]:
    """{criterion: {mechanism: finished runs with a validation loss}}, criteria in t6.model.match's order."""
    out: dict[str, dict[str, list[RunData]]] = {}
    for run in runs:
        criterion, label = criterion_of(run), mechanism_label(run)
        if run.status == "FINISHED" and criterion and label and LOSS in run.metrics:
            out.setdefault(criterion, {}).setdefault(label, []).append(run)
    order = [c for c in CRITERIA if c in out] + sorted(c for c in out if c not in CRITERIA)
    return {c: dict(sorted(out[c].items(), key=lambda item: rank(item[0]))) for c in order}


@dataclass
class Row:
    label: str
    losses: list[float]
    params: float | None
    heads: float | None
    kv_bytes: float | None

    @property
    def mean(self) -> float:
        return statistics.fmean(self.losses)


def row_of(label: str, runs: list[RunData]) -> Row:
    """A mechanism's row: its seeds' losses, and the sizes its first run logged (the same for every seed)."""
    run = runs[0]
    params = logged_fact(run, "match/params") or logged_fact(run, "model/params")
    kv = logged_fact(run, "match/kv_bytes") or logged_fact(run, "model/kv_cache_bytes_per_token")
    heads = logged_fact(run, "match/heads") or (float(run.param("size.n_head")) if run.param("size.n_head") else None)
    return Row(label, [r.metrics[LOSS] for r in runs], params, heads, kv)


def criterion_table(criterion: str, rows: dict[str, list[RunData]], reference: str = REFERENCE):
    """(Markdown table, findings): each row's sizes, validation loss mean ± CI, difference from the reference's
    row under this criterion and Welch's p; a finding per row, resolved (p < RESOLVED_P) or not."""
    built = {label: row_of(label, runs) for label, runs in rows.items()}
    ref = built.get(reference)
    header = "| attention | params | heads | KV bytes/token | seeds | val loss (mean ± 95% CI) | Δ vs " + reference
    lines = [header + " | p (Welch) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    findings: list[tuple[str, str, float, float | None]] = []  # (criterion, label, delta, p)
    for label, row in built.items():
        ci = confidence_interval(row.losses)
        loss = f"{row.mean:.4f}" + (f" ± {ci:.4f}" if ci is not None else "")
        diff = difference(row.losses, ref.losses) if ref is not None and label != reference else None
        delta = f"{diff.delta:+.4f}" if diff else ""
        p = "" if diff is None else ("–" if diff.p is None else f"{diff.p:.3f}")
        if diff is not None and diff.resolved:
            delta, p = f"**{delta}**", f"**{p}**"
        if diff is not None:
            findings.append((criterion, label, diff.delta, diff.p))
        cells = [
            f"{row.params / 1e6:.2f}M" if row.params else "–",
            f"{row.heads:.0f}" if row.heads else "–",
            f"{row.kv_bytes:,.0f}" if row.kv_bytes else "–",
            str(len(row.losses)),
            loss,
            delta,
            p,
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines), findings


def pareto_front(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The points (x, y, label) that no other point beats on both (x <= and y <=, one of them <), by x."""
    front = [
        p for p in points if not any(q[0] <= p[0] and q[1] <= p[1] and (q[0] < p[0] or q[1] < p[1]) for q in points)
    ]
    return sorted(front)


MARKERS = {"params": "o", "heads": "s", "kv_bytes": "^", "flops": "D"}


def plot_loss_vs_kv(table: dict[str, dict[str, list[RunData]]], path: Path) -> list[tuple[float, float, str]]:
    """Validation loss (mean, 95% CI bars) against KV bytes per token (log axis) for every row of every criterion,
    a colour per mechanism and a marker per criterion, and the Pareto front; returns the front's points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from t6.report.plots import line_style

    labels = sorted({label for rows in table.values() for label in rows}, key=rank)
    colors = {label: line_style(i)[0] for i, label in enumerate(labels)}
    fig, ax = plt.subplots(figsize=(9.5, 5), dpi=120)
    points = []
    for criterion, rows in table.items():
        for label, runs in rows.items():
            row = row_of(label, runs)
            if row.kv_bytes is None:
                continue
            ci = confidence_interval(row.losses) or 0.0
            ax.errorbar(
                row.kv_bytes, row.mean, yerr=ci, color=colors[label], marker=MARKERS.get(criterion, "x"),
                linestyle="none", capsize=2, markersize=6,
            )  # fmt: skip
            points.append((row.kv_bytes, row.mean, f"{label} ({criterion})"))
    front = pareto_front(points)
    if front:
        ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="black", linewidth=1, alpha=0.6)
    handles = [plt.Line2D([], [], color=colors[lb], marker="o", linestyle="none", label=lb) for lb in labels]
    handles += [
        plt.Line2D([], [], color="grey", marker=MARKERS.get(c, "x"), linestyle="none", label=f"match={c}")
        for c in table
    ]
    handles.append(plt.Line2D([], [], color="black", alpha=0.6, label="Pareto front"))
    ax.set_xscale("log")
    ax.set_xlabel("KV cache bytes per token (bf16, all layers)")
    ax.set_ylabel("validation loss (mean over seeds, 95% CI)")
    ax.set_title("Validation loss against KV cache, every mechanism under every match")
    ax.grid(alpha=0.3)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return front


def matched_section(runs: list[RunData], out: Path) -> tuple[list[str], list[Path]]:
    """report.md's matched comparison (Markdown lines) and its figure, for runs under several criteria."""
    table = rows_by_criterion(runs)
    parts = ["## Matched comparisons (the match group)", ""]
    parts += [
        f"One table per criterion: each mechanism's sizes solved so that the criterion equals {REFERENCE}'s "
        "(t6.model.match); validation loss as mean ± the 95% confidence interval over the seeds (Student's t); "
        f"Δ and Welch's two-sided p against {REFERENCE} under the same criterion, bold where p < {RESOLVED_P}.",
        "",
    ]
    findings = []
    for criterion, rows in table.items():
        markdown, found = criterion_table(criterion, rows)
        findings += found
        parts += [f"### match={criterion}", "", markdown, ""]
    resolved = [f for f in findings if f[3] is not None and f[3] < RESOLVED_P]
    unresolved = [f for f in findings if f not in resolved]
    name = lambda f: f"{f[1]} under {f[0]} ({f[2]:+.4f}, p {'–' if f[3] is None else f'{f[3]:.3f}'})"  # noqa: E731
    parts += ["Significant (p < 0.05): " + ("; ".join(map(name, resolved)) or "none") + ".", ""]
    parts += ["Not significant: " + ("; ".join(map(name, unresolved)) or "none") + ".", ""]
    path = out / "val_loss_vs_kv.png"
    front = plot_loss_vs_kv(table, path)
    parts += ["### Validation loss against KV cache", "", f"![val_loss_vs_kv]({path.name})", ""]
    parts += ["Pareto front (no row has both less cache and a lower loss): "]
    parts[-1] += "; ".join(f"{label} at {kv:,.0f} B/token, {loss:.4f}" for kv, loss, label in front) + "."
    parts.append("")
    return parts, [path]
