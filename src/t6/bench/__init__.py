"""Inference benchmarks, each runnable as `python -m t6.bench.NAME` (table on stdout, `--json PATH`).

- kv_memory: bytes of the allocated KV caches per token, and the longest context a budget holds;
- decode: tokens/s of single-token decoding against a cache filled to each context length;
- prefill: tokens/s of processing a prompt of each length.

Every mechanism is measured side by side in one run and reported as a ratio to MHA.
"""
