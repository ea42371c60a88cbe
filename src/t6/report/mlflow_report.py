"""`python report.py`: MLflow runs as the paper's tables and figures.

    python report.py --sweep logs/train/multiruns/DATE           # the sweep run in that directory
    python report.py --experiment NAME                          # every run of an experiment
    python report.py --experiment NAME --parent latest          # the newest sweep (parent run) in it
    python report.py --parent RUN_ID --decode-json decode.json --out experiments/NAME

Writes report.md, train_loss.png, val_loss.png and val_ppl.png into --out and logs them as
artifacts (report/) to the sweep's parent run, or to a new run named `report` in the experiment.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from t6.report import build_report, find_runs, load_decode_records, load_runs, log_report
from t6.tracking.sweep import read_sweep_file


def project_root() -> Path:
    """The project (T6_ROOT, which t6.cli.entry sets from the entry script's folder), else the working directory."""
    return Path(os.environ.get("T6_ROOT") or Path.cwd())


def folder_name(name: str) -> str:
    """A run or experiment name as one path component without spaces:
    "sweep 2026-01-02_03-04" -> "sweep-2026-01-02_03-04"."""
    return re.sub(r"[^\w.+-]+", "-", name).strip("-") or "report"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", help="MLflow experiment name")
    parser.add_argument("--parent", help="a sweep's parent run id, or `latest` (the newest sweep of --experiment)")
    parser.add_argument("--sweep", help="a sweep's directory (hydra.sweep.dir): its store and parent run")
    parser.add_argument(
        "--tracking-uri",
        default=os.environ.get("MLFLOW_TRACKING_URI", f"sqlite:///{project_root() / 'mlruns' / 'mlflow.db'}"),
        help="MLflow store (default: $MLFLOW_TRACKING_URI, else the project's mlruns/mlflow.db)",
    )
    parser.add_argument("--out", help="output folder (default: reports/<experiment or parent run>)")
    parser.add_argument(
        "--decode-json", help="records of `python -m t6.bench.decode --json PATH` for the tokens/s column"
    )
    parser.add_argument(
        "--group-by",
        default="attention.name",
        help="comma-separated run params that make a table row (default: attention.name)",
    )
    parser.add_argument("--title", help="report title")
    parser.add_argument("--no-log", action="store_true", help="write the files only, log nothing to MLflow")
    args = parser.parse_args(argv)
    if args.sweep:
        if args.parent or args.experiment:
            parser.error("--sweep names the sweep's parent run itself; drop --parent/--experiment")
        info = read_sweep_file(args.sweep)  # missing or damaged: a user error naming the file
        args.parent, args.tracking_uri = info["parent_run_id"], info["tracking_uri"]
    if not args.experiment and not args.parent:
        parser.error("give --experiment NAME, --parent RUN_ID or --sweep DIR")
    return args


def main(argv: list[str] | None = None) -> Path:
    import mlflow

    from t6.tracking.mlflow import check_tracking_uri

    args = parse_args(argv)  # a damaged sweep file: a UserError naming it
    check_tracking_uri(args.tracking_uri)
    client = mlflow.MlflowClient(tracking_uri=args.tracking_uri)
    decode = load_decode_records(args.decode_json) if args.decode_json else None  # before reading runs
    runs, experiment_id, parent = find_runs(client, args.experiment, args.parent)
    name = args.experiment or client.get_experiment(experiment_id).name
    out = Path(args.out or project_root() / "reports" / folder_name(parent.info.run_name if parent else name))
    title = args.title or (f"{name}: {parent.info.run_name} ({parent.info.run_id[:8]})" if parent else name)
    report = build_report(
        load_runs(client, runs), out, title, tuple(args.group_by.split(",")), decode, args.decode_json
    )
    print(report.markdown)
    print(f"\nwritten to {out}")
    if not args.no_log:
        run_id = log_report(client, report, experiment_id, parent)
        print(f"logged as artifacts report/ of run {run_id} (experiment {experiment_id})")
    return out
