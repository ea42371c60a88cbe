"""Turn MLflow runs into the paper's tables and figures.

`python report.py --experiment NAME` (or `--parent RUN_ID` for one sweep) reads the runs from
the tracking store and writes, into an output folder and as MLflow artifacts:

- report.md: the runs and their status, validation loss/perplexity, the zero-/two-shot tables
  (one row per attention, one column per task, mean ± std over seeds, best per column in bold),
  and parameters / KV cache per token / decode tokens/s next to quality;
- train_loss.png, val_loss.png, val_ppl.png: the curves of every attention vs training tokens.

Only finished runs enter a table or a curve. Unfinished or failed runs, and finished runs that
lack a metric, are listed by name in the report; nothing is dropped or averaged in silently.

The pieces are pure functions over `RunData` (plain data read from the store by `load_runs`),
so tests build them from real runs and check every number.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

# The paper's metric per task (Tables 2-5): length-normalized accuracy where the answer choices
# differ in length, plain accuracy elsewhere.
ACC_NORM_TASKS = ("arc_easy", "arc_challenge", "hellaswag", "openbookqa", "piqa", "sciq")
ACC_TASKS = ("boolq", "winogrande", "mmlu", "social_iqa")
PAPER_TASK_ORDER = ("arc_easy", "arc_challenge", "boolq", "hellaswag", "openbookqa", "piqa", "sciq",
                    "social_iqa", "winogrande", "mmlu")
CURVES = {"train/loss": "Training loss", "val/loss": "Validation loss", "val/ppl": "Validation perplexity"}
QUALITY = ("train/loss", "val/loss", "val/ppl")  # lower is better
EVAL_KEY = re.compile(r"^eval/(\d+)shot/(.+)/([^/]+)$")  # eval/{n}shot/{task}/{metric}
SHOT_NAMES = {0: "Zero-shot", 1: "One-shot", 2: "Two-shot"}
REPORT_TAG = "t6.kind"  # runs created by this module carry t6.kind=report and are never reported on
PARENT_TAG = "mlflow.parentRunId"


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


# --------------------------------------------------------------------------- grouping


def group_label(run: RunData, group_by: tuple[str, ...]) -> str | None:
    """The row a run belongs to, e.g. "tpa" for group_by=("attention.name",); None when a key is missing."""
    parts = []
    for key in group_by:
        value = run.param(key)
        if value is None and key == "attention.name":
            value = run.tags.get("attention")
        if value is None:
            return None
        parts.append(value)
    return "/".join(parts)


# Params that do not change what a run measures: where it wrote, what it was called, how it was
# tracked and checkpointed, and the seed itself. Runs of a row are pooled only when all else matches.
NOT_POOLED = ("seed", "data.seed", "run_name", "experiment_name", "task_name", "ckpt_path", "auto_resume",
              "print_config", "trainer.default_root_dir")
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
    note = (f"{label}: its runs differ in more than the seed ({', '.join(keys)}), so they are not averaged "
            f"together: one row per setting")
    return rows, note


@dataclass
class Grouped:
    groups: dict[str, list[RunData]]  # finished runs per row, rows in first-seen order
    excluded: list[tuple[RunData, str]]  # runs left out and why
    notes: list[str] = field(default_factory=list)  # rows split because their runs differ in more than the seed


def group_runs(runs: Iterable[RunData], group_by: tuple[str, ...] = ("attention.name",)) -> Grouped:
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
    return Grouped(groups, excluded, notes)


def last_step(run: RunData) -> int | None:
    """The run's last optimizer step: the `last_step` tag train() sets at the end, else the latest
    logged curve point (a value logged at step s follows s + 1 steps)."""
    if str(run.tags.get("last_step", "")).isdigit():
        return int(run.tags["last_step"])
    steps = [s for hist in run.history.values() for s, _ in hist]
    return max(steps) + 1 if steps else None


# --------------------------------------------------------------------------- numbers


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


# --------------------------------------------------------------------------- downstream evaluation


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
        best = [best_rows({r: cells[i] for r, cells in self.rows.items()}, hib)
                for i, hib in enumerate(self.higher_is_better)]
        lines = [f"| {row_header} | " + " | ".join(self.columns) + " |",
                 "|---|" + "---:|" * len(self.columns)]
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
    per_run = {run.run_id: eval_metrics(run.metrics).get(shots, {}) for runs in groups.values() for run in runs}
    logged: dict[str, set[str]] = defaultdict(set)
    for tasks in per_run.values():
        for task, metrics in tasks.items():
            logged[task] |= set(metrics)
    if not logged:
        return None
    columns = [(task, task_metric(task, logged[task])) for task in task_order(logged)]
    columns = [(t, m) for t, m in columns if m is not None]
    rows, missing = {}, []
    for label, runs in groups.items():
        cells, averages = [], []
        per_task: dict[str, list[float]] = defaultdict(list)
        for run in runs:
            values = []
            for task, metric in columns:
                value = per_run[run.run_id].get(task, {}).get(metric)
                if value is None or not math.isfinite(value):
                    missing.append(f"{run.name} ({run.run_id[:8]}): eval/{shots}shot/{task}/{metric}")
                else:
                    per_task[task].append(value)
                    values.append(value)
            if len(values) == len(columns):
                averages.append(statistics.fmean(values))
        cells = [aggregate(per_task[task], len(runs)) for task, _ in columns] + [aggregate(averages, len(runs))]
        rows[label] = cells
    headers = [f"{task} ({metric})" for task, metric in columns] + ["Avg."]
    title = f"{SHOT_NAMES.get(shots, f'{shots}-shot')} evaluation (accuracy %, mean ± std over seeds; " \
            "metric per task in its header; Avg. = mean of the task columns per run)"
    return Table(title, headers, rows, [True] * len(headers), scale=100.0, digits=2, missing=missing)


def quality_table(groups: dict[str, list[RunData]]) -> Table:
    rows, missing = {}, []
    for label, runs in groups.items():
        cells = []
        for key in QUALITY:
            values = [r.metrics[key] for r in runs if key in r.metrics]
            missing += [f"{r.name} ({r.run_id[:8]}): {key}" for r in runs if key not in r.metrics]
            cells.append(aggregate(values, len(runs)))
        rows[label] = cells
    return Table("Final losses (mean ± std over seeds; lower is better)", list(QUALITY), rows,
                 [False] * len(QUALITY), digits=4, missing=missing)


# --------------------------------------------------------------------------- tokens and curves


def tokens_per_step(params: dict[str, str]) -> int:
    """Training tokens per optimizer step: global batch (data.global_batch_size, else data.batch_size
    x trainer.devices x trainer.num_nodes) x data.seq_len. Raises KeyError naming the missing params."""

    def get(key: str) -> str | None:
        value = params.get(key)
        return None if value in (None, "None", "null", "") else value

    seq_len, global_batch = get("data.seq_len"), get("data.global_batch_size")
    missing = [] if seq_len else ["data.seq_len"]
    if global_batch is None:
        batch, devices = get("data.batch_size"), get("trainer.devices")
        if batch is None:
            missing.append("data.batch_size (or data.global_batch_size)")
        if devices is None or not str(devices).isdigit():
            missing.append(f"trainer.devices as a number (got {devices!r}; or data.global_batch_size)")
        if not missing:
            global_batch = int(batch) * int(devices) * int(get("trainer.num_nodes") or 1)
    if missing:
        raise KeyError("cannot compute tokens per step: missing params " + ", ".join(missing))
    return int(global_batch) * int(seq_len)


def curve(runs: list[RunData], key: str) -> tuple[list[float], list[float], list[float]] | None:
    """(tokens, mean, std) over the steps every run logged; a value logged at step s was seen
    after s+1 optimizer steps, i.e. at (s+1) x tokens_per_step tokens."""
    per_run = []
    for run in runs:
        tps = tokens_per_step(run.params)
        points = {}
        for step, value in run.history.get(key, []):
            points[(step + 1) * tps] = value  # a resumed run may log a step twice: the later value wins
        per_run.append(points)
    if not per_run or not all(per_run):
        return None
    common = sorted(set.intersection(*(set(p) for p in per_run)))
    means = [statistics.fmean(p[x] for p in per_run) for x in common]
    stds = [statistics.stdev([p[x] for p in per_run]) if len(per_run) > 1 else 0.0 for x in common]
    return [float(x) for x in common], means, stds


def _tokens_axis(value: float, _pos=None) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:g}{unit}"
    return f"{value:g}"


def plot_curves(groups: dict[str, list[RunData]], key: str, path: Path) -> list[str]:
    """One figure: `key` vs training tokens, a line per group (mean over seeds, band ± std).
    Returns the problems (groups not drawn and why)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    problems = []
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for label, runs in groups.items():
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
        (line,) = ax.plot(x, mean, label=f"{label} (n={len(runs)})", linewidth=1.4, marker="o" if few else None,
                          markersize=4)
        if len(runs) > 1:
            ax.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                            color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel("training tokens")
    ax.set_ylabel(key)
    ax.set_title(CURVES.get(key, key))
    ax.xaxis.set_major_formatter(FuncFormatter(_tokens_axis))
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return problems


# --------------------------------------------------------------------------- model size and KV cache


def _unflatten(params: dict[str, str], prefixes: tuple[str, ...]) -> dict:
    import yaml

    tree: dict = {}
    for key, raw in params.items():
        if not key.startswith(prefixes):
            continue
        value = None if raw in ("None", "null") else yaml.safe_load(raw) if isinstance(raw, str) else raw
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def model_stats_from_params(params: dict[str, str], bytes_per_element: int = 2) -> dict[str, float]:
    """Parameters and KV cache bytes per token (all layers, at bytes_per_element) of the run's model,
    built from its size.* and attention.* params on the meta device (no memory, no weights)."""
    import torch
    from omegaconf import OmegaConf

    from t6.config import model_config
    from t6.model import T6

    cfg = OmegaConf.create(_unflatten(params, ("size.", "attention.")))
    if "size" not in cfg or "attention" not in cfg:
        raise KeyError("the run has no size.* / attention.* params to rebuild its model from")
    with torch.device("meta"):
        model = T6(model_config(cfg))
    elements = sum(math.prod(shape) for block in model.blocks for shape in block.attn.cache_spec().values())
    return {"params": float(model.num_params()), "kv_cache_bytes_per_token": float(elements * bytes_per_element)}


def _logged(run: RunData, key: str) -> float | None:
    value = run.param(key)
    if value is not None:
        return float(value)
    return run.metrics.get(key)


def load_decode_records(path: str | Path) -> list[dict]:
    """Records of `python -m t6.bench.decode --json PATH`: a list, or a dict holding it under "records"/"results"."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"decode benchmark JSON {path} does not exist (make it with python -m t6.bench.decode --json {path})")
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        data = data.get("records", data.get("results"))
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{path}: expected a list of records (or {{\"records\": [...]}}) from t6.bench.decode")
    for i, record in enumerate(data):
        lacking = [k for k in ("attention", "context", "tokens_per_s") if k not in record]
        if lacking:
            raise ValueError(f"{path}: record {i} lacks {', '.join(lacking)}")
    return data


def tradeoff_table(groups: dict[str, list[RunData]], evals: dict[int, Table],
                   decode: list[dict] | None = None) -> tuple[str, list[str]]:
    """Parameters, KV cache per token and decode tokens/s next to the quality numbers (Markdown, notes)."""
    notes, computed = [], set()
    contexts = sorted({int(r["context"]) for r in decode or []})
    header = ["params", "KV cache / token"] + [f"decode tok/s @ {c}" for c in contexts] + ["val/loss", "val/ppl"]
    header += [f"{SHOT_NAMES.get(s, f'{s}-shot')} avg. (%)" for s in sorted(evals)]
    quality = quality_table(groups)
    lines = ["| attention | " + " | ".join(header) + " |", "|---|" + "---:|" * len(header)]
    for label, runs in groups.items():
        run = runs[0]
        params, kv = _logged(run, "model/params"), _logged(run, "model/kv_cache_bytes_per_token")
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
        attention = run.param("attention.name") or run.tags.get("attention", label)
        cells = [f"{params / 1e6:.2f}M" if params is not None else "–", _bytes(kv) if kv is not None else "–"]
        for context in contexts:
            speeds = [float(r["tokens_per_s"]) for r in decode if r["attention"] == attention and int(r["context"]) == context]
            cells.append(f"{statistics.fmean(speeds):.1f}" if speeds else "–")
        cells += [quality.rows[label][1].format(digits=4), quality.rows[label][2].format(digits=2)]
        cells += [evals[s].rows[label][-1].format(100.0, 2) for s in sorted(evals)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if computed:
        notes.append("parameters / KV cache of " + ", ".join(sorted(computed)) + " computed from the run's config "
                     "(model built on the meta device; KV cache at 2 bytes per element, all layers)")
    return "\n".join(lines), notes


def _bytes(n: float) -> str:
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n:.0f} B"


# --------------------------------------------------------------------------- the report


@dataclass
class Report:
    markdown: str
    files: list[Path]


def build_report(runs: list[RunData], out_dir: str | Path, title: str,
                 group_by: tuple[str, ...] = ("attention.name",), decode: list[dict] | None = None,
                 decode_source: str | None = None) -> Report:
    """Write report.md and the three curve figures into out_dir; return the Markdown and the files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    grouped = group_runs(runs, group_by)
    groups = grouped.groups
    parts = [f"# {title}", ""]

    parts += ["## Runs", "", "| run | id | group | seed | status | last step | val/loss | in tables |", "|---|---|---|---|---|---:|---:|---|"]
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

    trade, notes = tradeoff_table(groups, evals, decode)
    parts += ["## Memory and speed next to quality", ""]
    if decode_source:
        parts += [f"Decode tokens/s from `{decode_source}`.", ""]
    parts += [trade, ""] + [f"- {note}" for note in notes] + ([""] if notes else [])

    files = []
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


# --------------------------------------------------------------------------- MLflow


def _all_runs(client, experiment_ids: list[str], filter_string: str = "") -> list:
    runs, token = [], None
    while True:
        page = client.search_runs(experiment_ids, filter_string=filter_string, max_results=1000,
                                  order_by=["attributes.start_time ASC"], page_token=token)
        runs += list(page)
        token = page.token
        if not token:
            return runs


def find_runs(client, experiment: str | None = None, parent: str | None = None) -> tuple[list, str, object | None]:
    """(training runs, experiment id, parent run or None). parent="latest" picks the newest run of the
    experiment that has children; without a parent every run of the experiment except parents and reports."""
    experiment_id = None
    if experiment is not None:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            known = ", ".join(e.name for e in client.search_experiments())
            raise ValueError(f"no MLflow experiment named {experiment!r} in this store (it has: {known or 'none'})")
        experiment_id = exp.experiment_id
    if parent == "latest":
        if experiment_id is None:
            raise ValueError("--parent latest needs --experiment NAME")
        children = _all_runs(client, [experiment_id], f"tags.`{PARENT_TAG}` != ''")
        parents = {r.data.tags[PARENT_TAG] for r in children}
        if not parents:
            raise ValueError(f"experiment {experiment!r} has no sweep parent run; drop --parent to report on all its runs")
        parent = max((client.get_run(p) for p in parents), key=lambda r: r.info.start_time).info.run_id
    if parent is not None:
        parent_run = client.get_run(parent)
        experiment_id = parent_run.info.experiment_id
        runs = _all_runs(client, [experiment_id], f"tags.`{PARENT_TAG}` = '{parent}'")
        return runs, experiment_id, parent_run
    if experiment_id is None:
        raise ValueError("give an experiment (--experiment NAME) or a sweep's parent run (--parent RUN_ID)")
    runs = _all_runs(client, [experiment_id])
    parents = {r.data.tags.get(PARENT_TAG) for r in runs}
    runs = [r for r in runs if r.info.run_id not in parents and r.data.tags.get(REPORT_TAG) != "report"]
    return runs, experiment_id, None


def load_runs(client, runs: list) -> list[RunData]:
    """RunData for MLflow runs, with the histories of the curve metrics."""
    out = []
    for run in runs:
        history = {}
        for key in CURVES:
            if key in run.data.metrics:
                history[key] = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        out.append(RunData(run.info.run_id, run.info.run_name or run.info.run_id[:8], run.info.status,
                           dict(run.data.params), dict(run.data.tags), dict(run.data.metrics), history))
    return out


def log_report(client, report: Report, experiment_id: str, parent_run=None) -> str:
    """Log the report's files as artifacts under report/ of the parent run, or of a new run named
    `report` (tag t6.kind=report) in the experiment. Returns that run's id."""
    if parent_run is not None:
        run_id = parent_run.info.run_id
    else:
        run_id = client.create_run(experiment_id, run_name="report", tags={REPORT_TAG: "report"}).info.run_id
    for path in report.files:
        client.log_artifact(run_id, str(path), artifact_path="report")
    if parent_run is None:
        client.set_terminated(run_id)
    return run_id
