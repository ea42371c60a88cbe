"""Figures: one PNG per curve metric, a line per table row (mean over seeds, band ± std) vs training tokens."""

from __future__ import annotations

from pathlib import Path

from t6.report.curves import CURVES, curve
from t6.report.runs import RunData


def _tokens_axis(value: float, _pos=None) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:g}{unit}"
    return f"{value:g}"


LINESTYLES = ["-", "--", ":", "-."]


def line_style(i: int) -> tuple[str, str]:
    """(colour, line style) of the i-th line: matplotlib's colour cycle (ten colours by default), then
    the same colours dashed, dotted, dash-dotted, so up to 40 lines (a sweep of every mechanism) stay apart."""
    import matplotlib
    import matplotlib.colors

    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    return matplotlib.colors.to_hex(colors[i % len(colors)]), LINESTYLES[(i // len(colors)) % len(LINESTYLES)]


def plot_curves(groups: dict[str, list[RunData]], key: str, path: Path) -> list[str]:
    """One figure: `key` vs training tokens, a line per group (mean over seeds, band ± std).
    Returns the problems (groups not drawn and why)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    problems = []
    many = len(groups) > 6  # the legend goes beside the axes, and the bands fade, where it would cover lines
    fig, ax = plt.subplots(figsize=(9.5 if many else 7, 4.5), dpi=120)
    for i, (label, runs) in enumerate(groups.items()):
        try:
            data = curve(runs, key)
        except KeyError as err:
            problems.append(f"{label}: {err.args[0]}")
            continue
        if data is None:
            lacking = [r.name for r in runs if not r.history.get(key)]
            problems.append(f"{label}: no {key} history in {', '.join(lacking)}")
            continue
        x, mean, std = data
        few = len(x) <= 20  # markers where a line has few points (one point draws no line at all)
        color, linestyle = line_style(i)
        ax.plot(
            x,
            mean,
            label=f"{label} (n={len(runs)})",
            color=color,
            linestyle=linestyle,
            linewidth=1.4,
            marker="o" if few else None,
            markersize=4,
        )
        if len(runs) > 1:
            ax.fill_between(
                x,
                [m - s for m, s in zip(mean, std)],
                [m + s for m, s in zip(mean, std)],
                color=color,
                alpha=0.08 if many else 0.2,
                linewidth=0,
            )
    ax.set_xlabel("training tokens")
    ax.set_ylabel(key)
    ax.set_title(CURVES.get(key, key))
    ax.xaxis.set_major_formatter(FuncFormatter(_tokens_axis))
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small") if many else ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return problems
