"""Benchmarks: `python -m t6.bench.NAME` prints a table and writes `--json PATH`."""
