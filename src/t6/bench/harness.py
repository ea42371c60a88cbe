"""The benchmarks' harness: their command lines (`--attentions`, size, device, dtype, threads, JSON), the
fixed-width tables they print, the JSON they write (with the machine, versions and date), so each
`python -m t6.bench.NAME` holds only what it measures. `python -m t6.bench.suite` runs them as stages
(t6.bench.suite), and t6.report.experiments renders their JSON into experiments/*/README.md.

    parser = harness.parser(__doc__)
    harness.common_args(parser)
    args = harness.parse(parser, argv)
    result = harness.result("decode", args.device, records, size=args.size)
    harness.finish(result, COLUMNS, args.json)          # prints the table, writes the JSON
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
from pathlib import Path

import torch

from t6.hardware.device import DTYPES
from t6.model.attention import select


def parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's argument parser, its module docstring as the description."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def ints(text: str) -> list[int]:
    """ "1k,2k,16384" -> [1024, 2048, 16384]."""
    return [int(v[:-1]) * 1024 if v.lower().endswith("k") else int(v) for v in text.split(",") if v]


def positive_int(text: str) -> int:
    """An argument that must be a positive integer (a usage error otherwise)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def attention_names(spec: str) -> list[str]:
    """--attentions: names, `paper` (the paper's six) and `all` (every registered), comma-separated."""
    try:
        return select(spec)
    except (KeyError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e).strip("'\"")) from None


def resolve_device(name: str) -> str:
    """`auto`: cuda when available, else cpu; any other name as given."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def attention_args(parser: argparse.ArgumentParser, default: str = "paper") -> None:
    parser.add_argument(
        "--attentions",
        type=attention_names,
        default=default,
        help="mechanism names, `paper` (the paper's six) and `all` (every registered), comma-separated",
    )


def common_args(
    parser: argparse.ArgumentParser, size: str = "medium", device: str = "cpu", dtype: str = "float32"
) -> None:
    """--attentions, --size, --device, --dtype, --threads, --json (defaults per benchmark)."""
    attention_args(parser)
    parser.add_argument("--size", default=size, help="model width from conf/size/NAME.yaml")
    parser.add_argument("--device", type=resolve_device, default=device, help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default=dtype, choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--json", type=Path, default=None, help="write the records to this JSON file")


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parser's arguments, with --threads applied."""
    args = parser.parse_args(argv)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    return args


def layer_args(parser: argparse.ArgumentParser, contexts: str, contexts_help: str) -> None:
    """The options of the one-layer inference benchmarks (decode, prefill): lengths, batch, scope."""
    parser.add_argument("--contexts", default=contexts, help=contexts_help)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--scope",
        default="attention",
        choices=["attention", "block"],
        help="one attention layer, or the whole decoder block (adds the norms and SwiGLU)",
    )


def table(records: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format) -> a fixed-width text table. A column whose key no record has is
    left out (GPU time on the CPU); a record without a value leaves its cell empty."""
    columns = [c for c in columns if any(c[0] in r for r in records)]
    cells = [[h for _, h, _ in columns]]
    for r in records:
        cells.append([("" if r.get(k) is None else format(r[k], f)) for k, _, f in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: Path | None, payload: dict, quiet: bool = False) -> None:
    """payload as JSON at path (its folder made); quiet: without saying so (a benchmark rewriting its JSON as its
    records come in, so a run cut short keeps what it measured)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(payload, indent=2))
        tmp.replace(path)
        if not quiet:
            print(f"wrote {path}")


def machine_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's processor name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str) -> dict:
    """What a number was measured with, and when: the machine, torch, triton and CUDA versions, the device,
    CPU threads, the date (the tables of experiments/*/README.md name them)."""
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    return {
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "device": device if not device.startswith("cuda") else torch.cuda.get_device_name(device),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": machine_name(),
        "date": datetime.date.today().isoformat(),
    }


def result(benchmark: str, device: str, records: list[dict], **fields) -> dict:
    """What a benchmark writes: its name (the table layout, t6.report.experiments), the environment, its
    settings and its records."""
    return {"benchmark": benchmark, **fields, "environment": environment(device), "records": records}


def finish(result: dict, columns: list[tuple[str, str, str]] | None, path: Path | None) -> None:
    """Print the records as a table (columns) and write the result to path (when given)."""
    if columns is not None:
        print(table(result["records"], columns), flush=True)
    write_json(path, result)


def run_main(parser: argparse.ArgumentParser, argv: list[str] | None, run, columns) -> dict:
    """A benchmark's main: parse argv (--threads applied), run(args) -> its result, print the table of `columns`
    (None: the benchmark printed its own) and write the JSON (--json)."""
    args = parse(parser, argv)
    result = run(args)
    finish(result, columns, args.json)
    return result
