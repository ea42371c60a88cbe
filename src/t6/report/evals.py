"""The downstream-evaluation columns: which tasks a run logged, which metric stands for each task,
and the order of the columns."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Iterable

# The paper's metric per task (Tables 2-5): length-normalized accuracy where the answer choices
# differ in length, plain accuracy elsewhere.
ACC_NORM_TASKS = ("arc_easy", "arc_challenge", "hellaswag", "openbookqa", "piqa", "sciq")
ACC_TASKS = ("boolq", "winogrande", "mmlu", "social_iqa")
PAPER_TASK_ORDER = ("arc_easy", "arc_challenge", "boolq", "hellaswag", "openbookqa", "piqa", "sciq",
                    "social_iqa", "winogrande", "mmlu")
EVAL_KEY = re.compile(r"^eval/(\d+)shot/(.+)/([^/]+)$")  # eval/{n}shot/{task}/{metric}


def eval_metrics(metrics: dict[str, float]) -> dict[int, dict[str, dict[str, float]]]:
    """{shots: {task: {metric: value}}} from eval/{n}shot/{task}/{metric} keys (the avg key is not a task)."""
    found: dict[int, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for key, value in metrics.items():
        match = EVAL_KEY.match(key)
        if match:
            shots, task, metric = int(match[1]), match[2], match[3]
            found[shots][task][metric] = value
    return {s: dict(t) for s, t in found.items()}


def task_metric(task: str, logged: set[str]) -> str | None:
    """The metric a task is reported with: the paper's choice for its tasks; acc_norm if logged, else acc,
    else the only other (non-stderr) metric, for the rest."""
    if task in ACC_NORM_TASKS:
        return "acc_norm"
    if task in ACC_TASKS:
        return "acc"
    for metric in ("acc_norm", "acc"):
        if metric in logged:
            return metric
    rest = sorted(m for m in logged if not m.endswith("_stderr"))
    return rest[0] if rest else None


def task_order(tasks: Iterable[str]) -> list[str]:
    tasks = set(tasks)
    return [t for t in PAPER_TASK_ORDER if t in tasks] + sorted(tasks - set(PAPER_TASK_ORDER))
