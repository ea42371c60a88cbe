"""KV cache memory: bytes per token of the caches each mechanism really allocates, and the
longest context a memory budget holds, at the paper's sizes.

    python -m t6.bench.kv_memory --sizes small,medium,large --dtype bfloat16 --budget-gib 16 \\
        --json results/kv_memory.json

For each size (conf/size/NAME.yaml, parameter-matched head counts) the model is built on the
meta device (no weights allocated) and its caches are allocated for real on the CPU for
`PROBE` tokens at batch 1, every layer; the bytes of those tensors divided by `PROBE` are the
bytes per token of the whole model. The longest context is budget / (bytes per token x batch):
the cache alone, weights and activations not counted. Ratios are to MHA.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from t6.bench.common import environment, model_configs, table, write_json
from t6.model import T6

PROBE = 16  # tokens allocated per cache


def measure(cfg, dtype: torch.dtype) -> dict:
    with torch.device("meta"):
        model = T6(cfg)
    caches = model.build_kv_caches(1, PROBE, dtype, "cpu")
    total = sum(c.nbytes() for c in caches)
    return {
        "n_head": cfg.n_head,
        "n_layer": cfg.n_layer,
        "options": cfg.attention_options,
        "elements_per_token_layer": caches[0].elements_per_token(),
        "kv_cache_bytes_per_token": total // PROBE,
        "non_embedding_params": model.num_params(non_embedding=True),
    }


def run(args) -> dict:
    dtype = getattr(torch, args.dtype)
    budget = int(args.budget_gib * 2**30)
    records = []
    for size in args.sizes.split(","):
        rows = [{"attention": name, "size": size, **measure(cfg, dtype)}
                for name, cfg in model_configs(args.attentions.split(","), size).items()]
        mha = next((r for r in rows if r["attention"] == "mha"), None)
        for r in rows:
            r["max_context"] = budget // (r["kv_cache_bytes_per_token"] * args.batch)
            if mha:
                r["smaller_than_mha"] = mha["kv_cache_bytes_per_token"] / r["kv_cache_bytes_per_token"]
                r["context_vs_mha"] = r["max_context"] / mha["max_context"]
        print(table(rows, COLUMNS), flush=True)
        print()
        records += rows
    return {"benchmark": "kv_memory", "dtype": args.dtype, "budget_gib": args.budget_gib, "batch": args.batch,
            "environment": environment("cpu"), "records": records}


COLUMNS = [("size", "size", ""), ("attention", "attention", ""), ("n_head", "heads", "d"),
           ("non_embedding_params", "params (non-emb.)", ","), ("elements_per_token_layer", "numbers/token/layer", "d"),
           ("kv_cache_bytes_per_token", "cache B/token", ","), ("smaller_than_mha", "x smaller than MHA", ".2f"),
           ("max_context", "max context", ","), ("context_vs_mha", "context vs MHA", ".2f")]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attentions", default="mha,gqa,mqa,mla,tpa_kvonly,tpa")
    parser.add_argument("--sizes", default="small,medium,large")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--budget-gib", type=float, default=16.0, help="memory for the KV cache")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="write the records to this JSON file")
    args = parser.parse_args(argv)
    write_json(args.json, run(args))


if __name__ == "__main__":
    main()
