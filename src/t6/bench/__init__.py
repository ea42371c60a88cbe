"""Benchmarks, each runnable as `python -m t6.bench.NAME` (a table on stdout, `--json PATH`).

- train_step: tokens/s (and FLOPs per token) of forward + backward + optimizer step, per attention;
- kv_memory: bytes of the allocated KV caches per token, and the longest context a budget holds;
- decode: tokens/s of single-token decoding against a cache filled to each context length (one layer);
- generate: whole-model tokens/s of `T6.generate` per prompt length and batch, against the bandwidth bound;
- prefill: tokens/s of processing a prompt of each length;
- loader: training-data loader tokens/s alone vs what a training step consumes;
- eval_items: items/s of the lm-eval adapter, per-choice vs one shared prefill per item (local and long-context tasks);
- step_overhead: the host's time per decode step, dynamo's guards against a captured step's replay;
- machine: the device, versions, copy bandwidth and matmul peak;
- headline: the headline training run shrunk, with its compile, throughput, checkpoint and evaluation costs;
- kernel_fit: the Triton decode kernels compiled ahead of time for sm_90 (shared memory, registers, spills);
- suite: all of the above that matter on a GPU as stages, one command within a time budget.

Mechanisms are measured side by side in one run and reported as ratios to MHA. Their command lines, tables
and JSON are the harness's (t6.bench.harness).
"""
