"""Numbers over seeds: mean ± sample standard deviation of a table cell, and the best row of a column."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Cell:
    """Mean ± sample std over the runs that have the value; n of expected."""

    mean: float | None
    std: float | None
    n: int
    expected: int

    def format(self, scale: float = 1.0, digits: int = 2) -> str:
        if self.mean is None:
            return "–"
        text = f"{self.mean * scale:.{digits}f}"
        if self.std is not None:
            text += f" ± {self.std * scale:.{digits}f}"
        if self.n < self.expected:
            text += f" ({self.n}/{self.expected} runs)"
        return text


def aggregate(values: list[float], expected: int | None = None) -> Cell:
    expected = len(values) if expected is None else expected
    if not values:
        return Cell(None, None, 0, expected)
    std = statistics.stdev(values) if len(values) > 1 else None
    return Cell(statistics.fmean(values), std, len(values), expected)


def best_rows(cells: dict[str, Cell], higher_is_better: bool) -> set[str]:
    """The rows whose mean is best in a column (all of them when tied)."""
    means = {row: c.mean for row, c in cells.items() if c.mean is not None}
    if not means:
        return set()
    best = max(means.values()) if higher_is_better else min(means.values())
    return {row for row, m in means.items() if m == best}
