"""Running lm-evaluation-harness on a T6 and turning its results into MLflow metrics and tables.

Pure functions shared by the training callback and `python eval.py`:
  resolve_tasks   unknown task names and unreachable datasets fail here, before any training
  run_harness     one `simple_evaluate` per few-shot setting, with the global RNGs left untouched
  flat_metrics    {"eval/0shot/hellaswag/acc_norm": 0.31, ..., "eval/0shot/avg": 0.29}
  markdown_table  the paper's layout: tasks as columns, one row for this run
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from t6.errors import SettingError, Unreachable

log = logging.getLogger(__name__)

PREFETCH_HINT = (
    "Pre-fetch the datasets on a machine with internet access by running the same evaluation once "
    "(e.g. `python eval.py eval=paper eval.limit=1 ckpt_path=...`), which fills the Hugging Face datasets cache "
    "(~/.cache/huggingface, or $HF_HOME / $HF_DATASETS_CACHE); copy that cache to this machine and set "
    "HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 so that it is read without network access."
)


@dataclass
class EvalSpec:
    """What to evaluate: tasks, the metric of each task that enters the average, few-shot settings."""

    tasks: list[str]
    num_fewshot: list[int] = field(default_factory=lambda: [0, 2])
    metrics: dict[str, str] = field(default_factory=dict)  # task -> metric in the average (default "acc")
    avg_tasks: list[str] | None = None  # the tasks averaged into eval/{n}shot/avg (default: all)
    limit: int | float | None = None
    batch_size: int | str = "auto"  # rows per forward pass; auto: from the device's memory (T6LM.auto_batch_size)
    fewshot_seed: int = 1234
    include_path: list[str] = field(default_factory=list)

    def metric(self, task: str) -> str:
        return self.metrics.get(task, "acc")


def task_manager(include_path: list[str], names: list[str]):
    """A TaskManager that knows `names`: only the include paths when they hold every name (fast), else also
    lm-eval's built-in tasks (indexing them takes ~20 s, minutes on a busy machine), once no name is surely unknown
    (`absent_task_names`: a second)."""
    import difflib

    from lm_eval.tasks import TaskManager

    paths = [str(p) for p in include_path]
    if paths:
        local = TaskManager(include_path=paths, include_defaults=False)
        if all(n in local.all_tasks for n in names):
            return local
    absent, known = absent_task_names(names, paths)
    if absent:
        hints = {n: difflib.get_close_matches(n, known, n=3) for n in absent}
        raise SettingError(
            "eval.tasks names unknown lm-eval tasks: "
            + "; ".join(f"{n!r}" + (f" (did you mean {', '.join(h)}?)" if h else "") for n, h in hints.items())
            + ". `lm_eval ls tasks` lists them; local task YAMLs go in eval.include_path"
        )
    check_hub()  # lm-eval's own tasks read their datasets from the Hugging Face Hub (or its cache)
    return TaskManager(include_path=paths or None, include_defaults=True)


HUB_WAIT_S = 3.0  # how long the check waits for the Hugging Face Hub to accept a connection


def check_hub() -> None:
    """Unless HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set (the datasets then come from the cache alone), the
    Hugging Face Hub answers: a machine that cannot reach it fails here in seconds, naming the fix, instead of after
    minutes of the libraries' retries for each task's dataset."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE"):
        return
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=HUB_WAIT_S).close()
    except OSError as err:
        raise Unreachable(
            f"eval.tasks: lm-eval's tasks read their datasets from the Hugging Face Hub, which this machine cannot "
            f"reach ({url.hostname}: {err}). Where the datasets are in the cache, set HF_DATASETS_OFFLINE=1 "
            f"HF_HUB_OFFLINE=1 to read them from it. {PREFETCH_HINT}"
        ) from None


TASK_NAME = re.compile(r"^\s*(?:task|group|tag):\s*['\"]?([\w.-]+)", re.M)


def absent_task_names(names: list[str], include_path: list[str]) -> tuple[list[str], list[str]]:
    """(the names that appear nowhere in the task YAML files of lm-eval and of include_path, so that no TaskManager
    can know them; the task, group and tag names those files declare, for hints). Reading the files' text takes a
    second where lm-eval's index of them takes tens; a name this passes is checked by the index itself."""
    import lm_eval

    roots = [Path(lm_eval.__file__).parent / "tasks", *map(Path, include_path)]
    text = "\n".join(f.read_text(errors="ignore") for root in roots for f in root.rglob("*.yaml"))
    absent = [n for n in names if not re.search(rf"(?<![\w.-]){re.escape(n)}(?![\w.-])", text)]
    return absent, sorted(set(TASK_NAME.findall(text))) if absent else []


def resolve_tasks(spec: EvalSpec):
    """Check that every task name exists and its dataset can be loaded (downloading it when
    online, reading the datasets cache when offline). Returns the TaskManager to evaluate with."""
    import difflib

    if not spec.tasks:
        raise SettingError("eval.tasks is empty; list lm-eval task names or choose eval=none")
    bad_shots = [n for n in spec.num_fewshot if int(n) < 0]
    if bad_shots:
        raise SettingError(f"eval.num_fewshot={spec.num_fewshot} holds negative values")
    tm = task_manager(spec.include_path, spec.tasks)
    unknown = [n for n in spec.tasks if n not in tm.all_tasks]
    if unknown:
        hints = {n: difflib.get_close_matches(n, tm.all_tasks, n=3) for n in unknown}
        raise SettingError(
            "eval.tasks names unknown lm-eval tasks: "
            + "; ".join(f"{n!r}" + (f" (did you mean {', '.join(h)}?)" if h else "") for n, h in hints.items())
            + ". `lm_eval ls tasks` lists them; local task YAMLs go in eval.include_path"
        )
    try:
        tm.load(list(spec.tasks))  # builds every task: loads (or downloads) its dataset
    except Exception as err:  # datasets raises many kinds: ConnectionError, FileNotFoundError, DatasetNotFoundError...
        offline = os.environ.get("HF_DATASETS_OFFLINE") or os.environ.get("HF_HUB_OFFLINE")
        raise Unreachable(
            f"cannot load the datasets of eval.tasks={list(spec.tasks)}: {type(err).__name__}: {err}\n"
            + (
                "HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set and the cache lacks them. "
                if offline
                else "This machine may have no internet access. "
            )
            + PREFETCH_HINT
        ) from err
    return tm


@contextmanager
def preserved_rng():
    """Leave Python's, NumPy's and torch's global random states as they were."""
    py, np_state, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextmanager
def eval_mode(model: torch.nn.Module):
    """model.eval() under torch.no_grad(), restoring the previous train/eval flag of every module."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        for m, training in modes:
            m.training = training


def run_harness(
    model: torch.nn.Module, spec: EvalSpec, tm, data_parallel: bool = False, tokenizer=None
) -> dict[int, dict | None]:
    """{num_fewshot: lm-eval results} for the T6 `model`, evaluated as it is (no copy, no conversion), its text
    encoded by `tokenizer` (a t6.data.tokenizer.Tokenizer: the model's; None: GPT-2).
    data_parallel: every rank of the process group calls this with its own whole model and scores
    its share of the requests (t6.evaluation.parallel); the results are rank 0's, None elsewhere."""
    from lm_eval import evaluator

    from t6.evaluation.adapter import T6LM
    from t6.evaluation.parallel import DataParallelT6LM

    lm_eval_log = logging.getLogger("lm_eval")
    if lm_eval_log.level == logging.NOTSET:  # its per-request INFO lines, in our log format, unless asked for
        lm_eval_log.setLevel(logging.WARNING)
    out = {}
    with eval_mode(model), preserved_rng():
        lm = (DataParallelT6LM if data_parallel else T6LM)(model=model, batch_size=spec.batch_size, tokenizer=tokenizer)
        for n in spec.num_fewshot:
            out[int(n)] = evaluator.simple_evaluate(
                model=lm,
                tasks=list(spec.tasks),
                num_fewshot=int(n),
                limit=spec.limit,
                task_manager=tm,
                log_samples=False,
                random_seed=None,
                numpy_random_seed=None,
                torch_random_seed=None,
                fewshot_random_seed=spec.fewshot_seed,
            )
    return out


def flat_metrics(results: dict[int, dict], spec: EvalSpec) -> dict[str, float]:
    """lm-eval's "acc,none" keys as MLflow names eval/{n}shot/{task}/{metric}, plus eval/{n}shot/avg
    over spec.avg_tasks with each task's chosen metric."""
    flat = {}
    for n, res in results.items():
        for task, values in res["results"].items():
            for key, value in values.items():
                metric, _, filt = key.partition(",")
                if not filt or not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
                    continue
                name = metric if filt == "none" else f"{metric}_{filt}"
                flat[f"eval/{n}shot/{task}/{name}"] = float(value)
        chosen = [chosen_value(res, task, spec.metric(task)) for task in (spec.avg_tasks or spec.tasks)]
        flat[f"eval/{n}shot/avg"] = float(np.mean(chosen))
    return flat


def chosen_value(res: dict, task: str, metric: str) -> float:
    try:
        return float(res["results"][task][f"{metric},none"])
    except KeyError as err:
        have = sorted(res["results"].get(task, {}))
        raise SettingError(f"lm-eval results for {task!r} have no {metric!r} (eval.metrics); they have {have}") from err


def markdown_table(results: dict[int, dict], spec: EvalSpec, run_name: str) -> str:
    """One table per few-shot setting: tasks as columns (value of each task's chosen metric, in %), Avg last."""
    tasks = list(spec.tasks)
    blocks = []
    for n, res in results.items():
        head = ["Run", *[f"{t} ({spec.metric(t)})" for t in tasks], "Avg."]
        values = [chosen_value(res, t, spec.metric(t)) for t in tasks]
        avg = np.mean([chosen_value(res, t, spec.metric(t)) for t in (spec.avg_tasks or tasks)])
        row = [run_name, *[f"{100 * v:.2f}" for v in values], f"{100 * avg:.2f}"]
        blocks.append(
            f"**{n}-shot**\n\n| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n| " + " | ".join(row) + " |\n"
        )
    return "\n".join(blocks)


def log_results(client, run_id: str, results: dict[int, dict], spec: EvalSpec, step: int, run_name: str) -> dict:
    """Metrics at `step`, the full results JSON and the markdown table as artifacts under eval/step{step}/."""
    from mlflow.entities import Metric
    from mlflow.utils.time import get_current_time_millis

    metrics = flat_metrics(results, spec)
    now = get_current_time_millis()
    client.log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()], synchronous=True)
    folder = f"eval/step{step:06d}"
    client.log_text(
        run_id, json.dumps({str(n): r for n, r in results.items()}, indent=2, default=str), f"{folder}/results.json"
    )
    client.log_text(run_id, markdown_table(results, spec, run_name), f"{folder}/table.md")
    return metrics


def spec_from_config(eval_cfg: dict, include_path: list[str | Path] = ()) -> EvalSpec:
    """EvalSpec from the `eval` config group (a plain dict)."""
    return EvalSpec(
        tasks=list(eval_cfg["tasks"]),
        num_fewshot=[int(n) for n in eval_cfg.get("num_fewshot", [0, 2])],
        metrics=dict(eval_cfg.get("metrics") or {}),
        avg_tasks=list(eval_cfg["avg_tasks"]) if eval_cfg.get("avg_tasks") else None,
        limit=eval_cfg.get("limit"),
        batch_size=eval_cfg.get("batch_size", "auto"),
        fewshot_seed=int(eval_cfg.get("fewshot_seed", 1234)),
        include_path=[str(p) for p in [*(eval_cfg.get("include_path") or []), *include_path]],
    )
