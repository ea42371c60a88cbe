"""Benchmarks, each runnable as `python -m t6.bench.NAME` (a table on stdout, `--json PATH`).

- train_step: tokens/s (and FLOPs per token) of forward + backward + optimizer step, per attention;
- kv_memory: bytes of the allocated KV caches per token, and the longest context a budget holds;
- decode: tokens/s of single-token decoding against a cache filled to each context length (one layer);
- generate: whole-model tokens/s of `T6.generate` per prompt length and batch, against the bandwidth bound;
- prefill: tokens/s of processing a prompt of each length;
- loader: training-data loader tokens/s alone vs what a training step consumes;
- eval_items: items/s of the lm-eval adapter, per-choice vs one shared prefill per item (local and long-context tasks).

Mechanisms are measured side by side in one run and reported as ratios to MHA.
"""
