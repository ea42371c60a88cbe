"""KV cache memory: bytes per token of each mechanism's cache, checked against the caches it
really allocates, and the longest context a memory budget holds, at the paper's sizes.

    python -m t6.bench.kv_memory --sizes small,medium,large --dtype bfloat16 --budget-gib 16 \\
        --json results/kv_memory.json

For each size (conf/size/NAME.yaml, parameter-matched head counts) the bytes per token of the
whole model are the fact `t6.model.facts.kv_bytes_per_token` (every layer's `cache_spec`). To
check that fact, the model is built on the meta device (no weights allocated) and its caches are
allocated for real on the CPU for `PROBE` tokens at batch 1, every layer; the bytes of those
tensors divided by `PROBE` are reported beside it (`allocated_vs_fact`, 1.00 when they agree).
The longest context is budget / (bytes per token x batch): the cache alone, weights and
activations not counted. Ratios are to MHA.
"""

from __future__ import annotations

from pathlib import Path

import torch

from t6.bench import harness
from t6.bench.common import model_configs, ratios_to_mha
from t6.bench.harness import DTYPES, attention_args, parse, table
from t6.model.attention import REFERENCE
from t6.model.facts import kv_bytes_per_token, kv_elements_per_token, meta_model, parameter_count

PROBE = 16  # tokens allocated per cache


def allocated_bytes_per_token(model, dtype: torch.dtype) -> float:
    """Bytes per token of the caches the model really allocates (every layer, batch 1)."""
    caches = model.build_kv_caches(1, PROBE, dtype, "cpu")
    return sum(c.nbytes() for c in caches) / PROBE


def measure(cfg, dtype: torch.dtype) -> dict:
    model = meta_model(cfg)
    fact = kv_bytes_per_token(model, dtype)
    allocated = allocated_bytes_per_token(model, dtype)
    return {
        "n_head": cfg.n_head,
        "n_layer": cfg.n_layer,
        "options": cfg.attention_options,
        "elements_per_token_layer": kv_elements_per_token(model),
        "kv_cache_bytes_per_token": fact,
        "allocated_bytes_per_token": allocated,
        "allocated_vs_fact": allocated / fact,
        "non_embedding_params": parameter_count(model, non_embedding=True),
    }


def run(args) -> dict:
    dtype = DTYPES[args.dtype]
    budget = int(args.budget_gib * 2**30)
    records = []
    for size in args.sizes.split(","):
        rows = [
            {"attention": name, "size": size, **measure(cfg, dtype)}
            for name, cfg in model_configs(args.attentions, size).items()
        ]
        mha = next((r for r in rows if r["attention"] == REFERENCE), None)
        for r in rows:
            r["max_context"] = budget // (r["kv_cache_bytes_per_token"] * args.batch)
            r["smaller_than_mha"] = mha["kv_cache_bytes_per_token"] / r["kv_cache_bytes_per_token"] if mha else None
        ratios_to_mha(rows, "max_context", "context_vs_mha")
        print(table(rows, COLUMNS), flush=True)
        print()
        for r in rows:
            if r["allocated_vs_fact"] != 1:
                print(
                    f"note: {size} {r['attention']} allocates {r['allocated_bytes_per_token']:,.0f} B/token, "
                    f"cache_spec says {r['kv_cache_bytes_per_token']:,}"
                )
        records += rows
    return harness.result("kv_memory", "cpu", records, dtype=args.dtype, budget_gib=args.budget_gib, batch=args.batch)


COLUMNS = [
    ("size", "size", ""),
    ("attention", "attention", ""),
    ("n_head", "heads", "d"),
    ("non_embedding_params", "params (non-emb.)", ","),
    ("elements_per_token_layer", "numbers/token/layer", "d"),
    ("kv_cache_bytes_per_token", "cache B/token", ","),
    ("allocated_vs_fact", "allocated/fact", ".2f"),
    ("smaller_than_mha", "x smaller than MHA", ".2f"),
    ("max_context", "max context", ","),
    ("context_vs_mha", "context vs MHA", ".2f"),
]


def main(argv=None) -> None:
    parser = harness.parser(__doc__)
    attention_args(parser)
    parser.add_argument("--sizes", default="small,medium,large")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--budget-gib", type=float, default=16.0, help="memory for the KV cache")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="write the records to this JSON file")
    args = parse(parser, argv)
    harness.finish(run(args), None, args.json)


if __name__ == "__main__":
    main()
