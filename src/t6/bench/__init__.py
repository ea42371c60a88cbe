"""Benchmarks: `python -m t6.bench.NAME`, each printing a table and writing --json PATH."""
