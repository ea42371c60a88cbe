"""Report on MLflow runs as the paper's tables and figures: `python report.py --sweep DIR` (--help for the rest).

Writes report.md and the figures into --out and logs them to the sweep's parent run (t6.report.mlflow_report)."""

from t6.cli import entry


def main(argv: list[str] | None = None):
    from t6.report.mlflow_report import main as run

    return run(argv)


if __name__ == "__main__":
    entry(main)  # a bad argument or file: one message, exit 2
