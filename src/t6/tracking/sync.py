"""Send what runs left in their outboxes to the MLflow store (writes made while the store did not answer):

    python -m t6.tracking.sync logs/train/runs/2025-01-01_12-00-00/mlflow-outbox [more outbox dirs ...]

Each spool (`*.jsonl`) is sent in order to the store it was written for (its first line), or to
--tracking-uri; what the store acknowledges is counted in the spool's `.sent` file, so running it again
sends only the rest. A run directory may be given for its `mlflow-outbox/`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from t6.errors import MissingFile
from t6.tracking.outbox import refused, send, sent_count, take_batch, unsent, write_sent


def spools(path: Path) -> list[Path]:
    folder = path if any(path.glob("*.jsonl")) else path / "mlflow-outbox"
    found = sorted(folder.glob("*.jsonl"))
    if not found:
        raise MissingFile(f"{path} holds no outbox spool (*.jsonl, or mlflow-outbox/*.jsonl)")
    return found


def sync_spool(spool: Path, tracking_uri: str | None = None) -> int:
    """Send a spool's unsent writes; returns how many were sent. Stops at the first the store refuses."""
    from collections import deque

    from mlflow import MlflowClient

    header = json.loads(spool.read_text(encoding="utf-8").splitlines()[0])
    client = MlflowClient(tracking_uri=tracking_uri or header["tracking_uri"])
    pending, sent_file = deque(unsent(spool)), spool.with_suffix(".sent")
    count = sent_count(sent_file)
    done = 0
    while pending:
        batch = take_batch(pending)
        try:
            send(client, batch)
        except Exception as err:
            if not refused(err):
                raise  # still unreachable: what is left stays for the next sync
            print(f"{spool}: the store refused a write, dropped ({err})", file=sys.stderr)
        for _ in batch:
            pending.popleft()
        count += len(batch)
        done += len(batch)
        write_sent(sent_file, count)
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path, help="outbox directories (or run directories)")
    parser.add_argument("--tracking-uri", help="send to this store instead of the one the spool was written for")
    args = parser.parse_args(argv)
    for path in args.paths:
        for spool in spools(path):
            print(f"{spool}: sent {sync_spool(spool, args.tracking_uri)} write(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
