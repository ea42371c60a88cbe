"""The test suite's time, from the JUnit XML pytest writes (`--junitxml`): the whole run, each file, the slowest tests.

    python -m pytest --junitxml=/tmp/suite.xml ...              # (make test ARGS="--junitxml=/tmp/suite.xml")
    python experiments/ci/durations.py /tmp/suite.xml NAME --wall-s SECONDS --workers N [--note TEXT]

writes experiments/ci/NAME.json ("benchmark": "test_durations"), whose tables experiments/ci/README.md renders
(python -m t6.report.experiments). --wall-s is the command's own wall time (`time make test`), install included;
--workers the pytest-xdist workers the tests ran on (the tests' seconds add up over them).
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

SLOWEST = 30  # tests listed one by one


def read_junit(path: Path) -> list[dict]:
    """Every test case: its file, name, seconds and outcome."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        parts = case.get("classname", "").split(".")  # tests.test_plan[.TestClass]
        at = next((i for i, part in enumerate(parts) if part.startswith("test_")), len(parts) - 1)
        cases.append(
            {
                "file": "/".join(parts[: at + 1]) + ".py",
                "test": ".".join([*parts[at + 1 :], case.get("name", "")]),
                "seconds": float(case.get("time", 0.0)),
                "outcome": outcome,
            }
        )
    return cases


def summarize(cases: list[dict], wall_s: float | None, note: str, workers: int = 1) -> dict:
    files: dict[str, dict] = defaultdict(lambda: {"tests": 0, "seconds": 0.0})
    for case in cases:
        files[case["file"]]["tests"] += 1
        files[case["file"]]["seconds"] += case["seconds"]
    outcomes = defaultdict(int)
    for case in cases:
        outcomes[case["outcome"]] += 1
    from t6.bench.harness import environment

    return {
        "benchmark": "test_durations",
        "environment": {**environment("cpu"), "threads": None},  # the suite's processes set their own
        "wall_s": wall_s,
        "workers": workers,
        "tests_s": round(sum(c["seconds"] for c in cases), 1),
        "outcomes": dict(outcomes),
        "note": note,
        "files": sorted(({"file": f, **v} for f, v in files.items()), key=lambda r: -r["seconds"]),
        "records": sorted(cases, key=lambda c: -c["seconds"])[:SLOWEST],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junit", type=Path)
    parser.add_argument("name", help="the JSON's name in experiments/ci/ (without .json)")
    parser.add_argument("--wall-s", type=float, help="the command's wall time, install included")
    parser.add_argument("--workers", type=int, default=1, help="pytest-xdist workers (make test: one per core)")
    parser.add_argument("--note", default="", help="how it ran (the command, what else the machine did)")
    args = parser.parse_args()
    payload = summarize(read_junit(args.junit), args.wall_s, args.note, args.workers)
    out = Path(__file__).parent / f"{args.name}.json"
    out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {out}: {len(payload['records'])} slowest of {sum(payload['outcomes'].values())} tests")


if __name__ == "__main__":
    main()
