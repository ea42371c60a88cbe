"""Prefill speed: tokens/s of processing a prompt of each length in one forward pass.

    python -m t6.bench.prefill --attentions paper --size medium \\
        --contexts 512,1k,2k,4k --json results/prefill.json

What is measured: one attention layer of the chosen width (parameter-matched heads, as in
`t6.bench.decode`), batch `--batch`, taking `context` prompt tokens at positions 0..context-1
into an empty, preallocated KV cache: projections, the cache write, causal attention and the
output projection (`--scope block` adds the norms and the SwiGLU). Mechanisms are timed
interleaved, round by round; the median round is reported, with ratios to MHA.
"""

from __future__ import annotations

import torch

from t6.bench import harness
from t6.bench.common import gpu_time_call, layer_kv_bytes_per_token, median, model_configs, ratios_to_mha, time_call
from t6.bench.decode import attention_of, build_layer
from t6.bench.harness import DTYPES, common_args, ints, layer_args, parse, table


def run(args) -> dict:
    dtype = DTYPES[args.dtype]
    contexts = ints(args.contexts)
    configs = model_configs(args.attentions, args.size, block_size=max(contexts))
    layers = {name: build_layer(cfg, args.scope, args.device, dtype) for name, cfg in configs.items()}
    records = []
    for context in contexts:
        x = torch.randn(args.batch, context, configs[next(iter(configs))].d_model, device=args.device, dtype=dtype)
        pos = torch.arange(context, device=args.device)
        caches = {
            name: attention_of(layer).build_kv_cache(args.batch, context, dtype, args.device)
            for name, layer in layers.items()
        }
        seconds = {name: [] for name in layers}
        with torch.inference_mode():
            for name, layer in layers.items():  # warm up
                time_call(lambda: layer(x, pos, caches[name]), 1, args.device)
            for _ in range(args.rounds):
                for name, layer in layers.items():
                    seconds[name].append(time_call(lambda: layer(x, pos, caches[name]), 1, args.device))
            gpu = {
                name: gpu_time_call(lambda: layer(x, pos, caches[name]), 1, args.device)
                for name, layer in layers.items()
            }
        rows = []
        for name in layers:
            s = median(seconds[name])
            rows.append(
                {
                    "attention": name,
                    "context": context,
                    "batch": args.batch,
                    "n_head": configs[name].n_head,
                    "ms": 1e3 * s,
                    **({} if gpu[name] is None else {"gpu_ms": 1e3 * gpu[name]}),  # CUDA only
                    "tokens_per_s": args.batch * context / s,
                    "kv_cache_bytes_per_token": layer_kv_bytes_per_token(configs[name], dtype),
                }
            )
        ratios_to_mha(rows, "tokens_per_s", "speed_vs_mha")
        print(table(rows, COLUMNS), flush=True)
        print()
        records += rows
    return harness.result("prefill", args.device, records, scope=args.scope, size=args.size, dtype=args.dtype)


COLUMNS = [
    ("attention", "attention", ""),
    ("context", "prompt", "d"),
    ("n_head", "heads", "d"),
    ("ms", "ms", ".1f"),
    ("gpu_ms", "GPU ms", ".1f"),
    ("tokens_per_s", "tokens/s", ".0f"),
    ("speed_vs_mha", "vs MHA", ".2f"),
]


def main(argv=None) -> None:
    parser = harness.parser(__doc__)
    common_args(parser)
    layer_args(parser, "512,1k,2k,4k", "prompt lengths")
    parser.add_argument("--rounds", type=int, default=3)
    args = parse(parser, argv)
    harness.finish(run(args), None, args.json)


if __name__ == "__main__":
    main()
