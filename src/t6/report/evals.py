"""The downstream-evaluation columns: which tasks a run logged, which metric stands for each task,
and the order of the columns.

The metric of a task is the eval config's (conf/eval/*.yaml `metrics`, the same map that decides
what enters eval/{n}shot/avg when the runs are evaluated); the paper's tasks come first, in the order
of conf/eval/paper.yaml. Tasks no eval config names fall back to acc_norm if logged, else acc, else
the only other (non-stderr) metric.
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from t6.errors import MissingFile, SettingError

EVAL_CONF = Path(__file__).resolve().parents[3] / "conf" / "eval"  # src/t6/report/ -> the project's conf/eval
PAPER_EVAL = "paper.yaml"
EVAL_KEY = re.compile(r"^eval/(\d+)shot/(.+)/([^/]+)$")  # eval/{n}shot/{task}/{metric}


@functools.cache
def eval_config_metrics(conf_dir: Path = EVAL_CONF) -> dict[str, str]:
    """{task: metric} from the `metrics` of every eval config in conf_dir; a task two configs give
    different metrics is an error naming both files."""
    import yaml

    if not (conf_dir / PAPER_EVAL).is_file():
        raise MissingFile(
            f"{conf_dir / PAPER_EVAL} does not exist: the report reads the metric of each task "
            "from the eval configs in conf/eval/"
        )
    chosen: dict[str, tuple[str, Path]] = {}
    for path in sorted(conf_dir.glob("*.yaml")):
        metrics = (yaml.safe_load(path.read_text()) or {}).get("metrics") or {}
        for task, metric in metrics.items():
            if task in chosen and chosen[task][0] != metric:
                raise SettingError(
                    f"task {task!r} has metric {chosen[task][0]!r} in {chosen[task][1]} but {metric!r} "
                    f"in {path}: give it one metric"
                )
            chosen[task] = (metric, path)
    return {task: metric for task, (metric, _) in chosen.items()}


@functools.cache
def paper_tasks(conf_dir: Path = EVAL_CONF) -> tuple[str, ...]:
    """The paper's tasks in its table order: `tasks` of conf/eval/paper.yaml."""
    import yaml

    path = conf_dir / PAPER_EVAL
    tasks = (yaml.safe_load(path.read_text()) or {}).get("tasks") if path.is_file() else None
    if not tasks:
        raise SettingError(f"{path} names no `tasks`: the report orders the paper's tasks by that list")
    return tuple(tasks)


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
    """The metric a task is reported with: the eval config's choice for the tasks it names (even when
    not logged: a missing metric is then listed, not replaced); acc_norm if logged, else acc, else the
    only other (non-stderr) metric, for the rest."""
    configured = eval_config_metrics()
    if task in configured:
        return configured[task]
    for metric in ("acc_norm", "acc"):
        if metric in logged:
            return metric
    rest = sorted(m for m in logged if not m.endswith("_stderr"))
    return rest[0] if rest else None


def task_order(tasks: Iterable[str]) -> list[str]:
    """The paper's tasks in its order, then the others by name."""
    tasks, paper = set(tasks), paper_tasks()
    return [t for t in paper if t in tasks] + sorted(tasks - set(paper))
