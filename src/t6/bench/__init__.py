"""Benchmarks: `python -m t6.bench.NAME --help`. Each prints a table and writes `--json PATH`."""
