"""Numbers over seeds: mean ± sample standard deviation of a table cell, the best row of a column, and
whether the seeds resolve a difference between two rows (Welch's t-test)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from scipy import stats as scipy_stats

RESOLVED_P = 0.05  # a difference counts as resolved by the seeds below this two-sided p-value


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


@dataclass(frozen=True)
class Difference:
    """Mean of `values` minus mean of the reference's, and Welch's two-sided p-value (None when a
    side has fewer than two values or neither side varies)."""

    delta: float
    p: float | None

    @property
    def resolved(self) -> bool:
        return self.p is not None and self.p < RESOLVED_P

    def format(self, scale: float = 1.0, digits: int = 3) -> str:
        text = f"{self.delta * scale:+.{digits}f}"
        return text + (f" (p={self.p:.3f})" if self.p is not None else " (p –)")


def difference(values: list[float], reference: list[float]) -> Difference | None:
    """Welch's t-test of values against reference (unequal variances); None without values on a side."""
    if not values or not reference:
        return None
    delta = statistics.fmean(values) - statistics.fmean(reference)
    if len(values) < 2 or len(reference) < 2:
        return Difference(delta, None)
    p = float(scipy_stats.ttest_ind(values, reference, equal_var=False).pvalue)
    return Difference(delta, p if math.isfinite(p) else None)
