"""Runs as plain data, and their grouping into table rows: one row per attention mechanism (or
per --group-by params), the seeds of a row pooled only when nothing else differs."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from t6.model.attention import PAPER


@dataclass
class RunData:
    """What the report needs from one MLflow run (all plain data)."""

    run_id: str
    name: str
    status: str  # FINISHED, RUNNING, FAILED, KILLED, SCHEDULED
    params: dict[str, str]
    tags: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # latest value of every metric
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # (step, value) per curve metric

    def param(self, key: str) -> str | None:
        value = self.params.get(key)
        return None if value in (None, "None", "null", "") else value


def attention_of(run: RunData) -> str | None:
    """The run's attention mechanism: its attention.name param, else its `attention` tag."""
    return run.param("attention.name") or run.tags.get("attention")


def group_label(run: RunData, group_by: tuple[str, ...]) -> str | None:
    """The row a run belongs to, e.g. "tpa" for group_by=("attention.name",); None when a key is missing."""
    parts = []
    for key in group_by:
        value = attention_of(run) if key == "attention.name" else run.param(key)
        if value is None:
            return None
        parts.append(value)
    return "/".join(parts)


# Params that do not change what a run measures: where it wrote, what it was called, how it was
# tracked and checkpointed, which mechanisms its sweep chose (a recipe's `compare`), and the seed
# itself. Runs of a row are pooled only when all else matches.
NOT_POOLED = (
    "seed",
    "data.seed",
    "compare",
    "run_name",
    "experiment_name",
    "task_name",
    "ckpt_path",
    "auto_resume",
    "print_config",
    "trainer.default_root_dir",
    # the plan's measurements of the machine it ran on, which vary with its load: the memory estimate (from the
    # memory available), the matmul peak (MFU's denominator) and the checkpoint interval timed from them
    "plan/memory_estimate_gib",
    "plan/peak_tflops",
    "plan/checkpoint_every_n_steps",
)
NOT_POOLED_PREFIXES = ("paths.", "logger.", "callbacks.", "model/")


def setup_of(run: RunData) -> dict[str, str | None]:
    """The run's params that decide its result, the seed excluded."""
    return {k: run.param(k) for k in run.params if k not in NOT_POOLED and not k.startswith(NOT_POOLED_PREFIXES)}


def split_by_setup(label: str, runs: list[RunData]) -> tuple[dict[str, list[RunData]], str | None]:
    """Runs of one row that differ in anything but the seed become rows of their own, labelled with
    the params that differ ("tpa (trainer.max_steps=35)"); returns the rows and a note saying why."""
    setups: list[tuple[dict, list[RunData]]] = []
    for run in runs:
        setup = setup_of(run)
        for known, members in setups:
            if known == setup:
                members.append(run)
                break
        else:
            setups.append((setup, [run]))
    if len(setups) == 1:
        return {label: runs}, None
    keys = sorted({k for setup, _ in setups for k in setup if len({s.get(k) for s, _ in setups}) > 1})
    shown = keys[:3]
    rows = {}
    for setup, members in setups:
        text = ", ".join(f"{k}={setup.get(k)}" for k in shown) + (", …" if len(keys) > len(shown) else "")
        rows[f"{label} ({text})"] = members
    note = (
        f"{label}: its runs differ in more than the seed ({', '.join(keys)}), so they are not averaged "
        f"together: one row per setting"
    )
    return rows, note


def mechanism_rank(runs: list[RunData]) -> tuple[int, int, str]:
    """Where a row stands: the paper's six in its order (t6.model.attention.PAPER), then every other
    mechanism by name, then rows without a mechanism."""
    mechanism = attention_of(runs[0])
    if mechanism is None:
        return (2, 0, "")
    if mechanism in PAPER:
        return (0, PAPER.index(mechanism), "")
    return (1, 0, mechanism)


@dataclass
class Grouped:
    groups: dict[str, list[RunData]]  # finished runs per row, rows in mechanism order (mechanism_rank)
    excluded: list[tuple[RunData, str]]  # runs left out and why
    notes: list[str] = field(default_factory=list)  # rows split because their runs differ in more than the seed


def group_runs(runs: Iterable[RunData], group_by: tuple[str, ...] = ("attention.name",)) -> Grouped:
    """Finished runs into rows; rows of one mechanism keep the order their runs were first seen in."""
    by_label: dict[str, list[RunData]] = {}
    excluded = []
    for run in runs:
        label = group_label(run, group_by)
        if run.status != "FINISHED":
            excluded.append((run, f"status {run.status}"))
        elif label is None:
            excluded.append((run, "no " + " / ".join(k for k in group_by if run.param(k) is None) + " param"))
        else:
            by_label.setdefault(label, []).append(run)
    groups, notes = {}, []
    for label, members in by_label.items():
        rows, note = split_by_setup(label, members)
        groups.update(rows)
        notes += [note] if note else []
    ordered = dict(sorted(groups.items(), key=lambda item: mechanism_rank(item[1])))  # sorted() is stable
    return Grouped(ordered, excluded, notes)


def last_step(run: RunData) -> int | None:
    """The run's last optimizer step: the `last_step` tag train() sets at the end, else the latest
    logged curve point (a value logged at step s follows s + 1 steps)."""
    if str(run.tags.get("last_step", "")).isdigit():
        return int(run.tags["last_step"])
    steps = [s for hist in run.history.values() for s, _ in hist]
    return max(steps) + 1 if steps else None
