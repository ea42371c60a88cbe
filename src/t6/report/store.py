"""The MLflow side: which runs a report covers, reading them as RunData, and logging the report's files."""

from __future__ import annotations

from t6.errors import SettingError
from t6.report.curves import CURVES
from t6.report.document import Report
from t6.report.runs import RunData

REPORT_TAG = "t6.kind"  # runs created by log_report carry t6.kind=report and are never reported on
PARENT_TAG = "mlflow.parentRunId"


def _all_runs(client, experiment_ids: list[str], filter_string: str = "") -> list:
    runs, token = [], None
    while True:
        page = client.search_runs(
            experiment_ids,
            filter_string=filter_string,
            max_results=1000,
            order_by=["attributes.start_time ASC"],
            page_token=token,
        )
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
            raise SettingError(f"no MLflow experiment named {experiment!r} in this store (it has: {known or 'none'})")
        experiment_id = exp.experiment_id
    if parent == "latest":
        if experiment_id is None:
            raise SettingError("--parent latest needs --experiment NAME")
        children = _all_runs(client, [experiment_id], f"tags.`{PARENT_TAG}` != ''")
        parents = {r.data.tags[PARENT_TAG] for r in children}
        if not parents:
            raise SettingError(
                f"experiment {experiment!r} has no sweep parent run; drop --parent to report on all its runs"
            )
        parent = max((client.get_run(p) for p in parents), key=lambda r: r.info.start_time).info.run_id
    if parent is not None:
        parent_run = client.get_run(parent)
        experiment_id = parent_run.info.experiment_id
        runs = _all_runs(client, [experiment_id], f"tags.`{PARENT_TAG}` = '{parent}'")
        return runs, experiment_id, parent_run
    if experiment_id is None:
        raise SettingError("give an experiment (--experiment NAME) or a sweep's parent run (--parent RUN_ID)")
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
        out.append(
            RunData(
                run.info.run_id,
                run.info.run_name or run.info.run_id[:8],
                run.info.status,
                dict(run.data.params),
                dict(run.data.tags),
                dict(run.data.metrics),
                history,
            )
        )
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
