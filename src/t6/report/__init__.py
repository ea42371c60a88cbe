"""Turn MLflow runs into the paper's tables and figures.

`python report.py --experiment NAME` (or `--parent RUN_ID` for one sweep) reads the runs from
the tracking store and writes, into an output folder and as MLflow artifacts:

- report.md: the runs and their status, validation loss/perplexity, the zero-/two-shot tables
  (one row per attention, one column per task, mean ± std over seeds, best per column in bold),
  and parameters / KV cache per token / decode tokens/s next to quality;
- train_loss.png, val_loss.png, val_ppl.png: the curves of every attention vs training tokens.

Only finished runs enter a table or a curve. Unfinished or failed runs, and finished runs that
lack a metric, are listed by name in the report; nothing is dropped or averaged in silently.
Rows follow the paper's six mechanisms in its order, then every other mechanism by name.

One job per module; the pieces are pure functions over `RunData` (plain data read from the store),
so tests build them from real runs and check every number:

- runs.py         RunData, and the grouping of runs into rows (mechanism, seeds pooled)
- stats.py        mean ± std over seeds, best row of a column
- evals.py        eval/{n}shot/{task}/{metric} keys; the metric of a task from conf/eval/
- curves.py       tokens per step, curves over seeds
- plots.py        the figures
- model_facts.py  parameters / KV cache per token (logged, else t6.model.facts)
- decode.py       records of t6.bench.decode
- tables.py       the Markdown tables
- matched.py      the matched comparison: a table per match criterion, loss against KV cache (Pareto front)
- document.py     report.md
- store.py        MLflow: finding and reading runs, logging the report
"""

from t6.report.curves import CURVES, curve, tokens_per_step
from t6.report.decode_records import load_decode_records
from t6.report.document import Report, build_report
from t6.report.evals import eval_metrics, task_metric, task_order
from t6.report.model_facts import model_stats_from_params
from t6.report.plots import plot_curves
from t6.report.runs import Grouped, RunData, group_label, group_runs, last_step
from t6.report.stats import Cell, aggregate, best_rows
from t6.report.store import find_runs, load_runs, log_report
from t6.report.tables import Table, eval_table, quality_table, tradeoff_table

__all__ = [
    "CURVES",
    "Cell",
    "Grouped",
    "Report",
    "RunData",
    "Table",
    "aggregate",
    "best_rows",
    "build_report",
    "curve",
    "eval_metrics",
    "eval_table",
    "find_runs",
    "group_label",
    "group_runs",
    "last_step",
    "load_decode_records",
    "load_runs",
    "log_report",
    "model_stats_from_params",
    "plot_curves",
    "quality_table",
    "task_metric",
    "task_order",
    "tokens_per_step",
    "tradeoff_table",
]
