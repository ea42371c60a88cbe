"""Whole-model generation speed: tokens/s of `T6.generate` per mechanism, prompt length and batch,
against the bound the device's memory bandwidth sets.

    python -m t6.bench.generate --attentions paper,gta --size medium --prompt-lengths 2k,32k \\
        --batches 1,16 --device cuda --dtype bfloat16 --json results/generate.json

Random weights and prompts, greedy decoding, no stop tokens. Each setting prefills the prompts and decodes
`--new-tokens` tokens; the decode speed is the difference of two generations (new_tokens + 1 tokens and 1 token:
the same prefill, then new_tokens decode steps and samples), so prefill is reported on its own. Each row names
the attention kernel a decode step ran (the fused operator and what implements it, SDPA's backend,
FlexAttention) and whether the steps were replayed as CUDA graphs. `--step` is generate's decoder: static (fixed
shapes; each cache bucket's step captured as a CUDA graph on CUDA and replayed), compiled (static, the step
compiled by inductor first), eager (views growing with the context; the CPU's fused operators), auto (static on
CUDA, eager elsewhere). The mechanisms run one after another (the caches of a long batch may not fit together).

The bound: a decode step reads every weight once (the tied embedding once, as the LM head) and each
row's cache up to its context, so it takes at least (weight bytes + batch x context x cache bytes per
token) / bandwidth, with the context at its mean over the decoded tokens; tokens/s is at most batch
over that. The bandwidth is the device's copy bandwidth (read + write), measured unless
`--bandwidth-gbs` gives it.
"""

from __future__ import annotations

import argparse

import torch

from t6.bench import harness
from t6.bench.common import attention_kernels, copy_bandwidth_gbs, median, model_configs, time_call
from t6.bench.harness import DTYPES, common_args, ints, table
from t6.model import T6, ModelConfig
from t6.model.facts import kv_bytes_per_token, parameter_count
from t6.model.t6 import DECODERS


def random_model(cfg: ModelConfig, device: str, dtype: torch.dtype) -> T6:
    torch.manual_seed(0)
    with torch.device(device):
        model = T6(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)  # the zero-initialized residual outputs too
    return model.to(dtype).eval()


def bound(cfg: ModelConfig, dtype: torch.dtype, batch: int, context: float, bandwidth_gbs: float) -> dict:
    """Bytes one decode step reads at least, and the tokens/s that allows at bandwidth_gbs."""
    weight_bytes = parameter_count(cfg) * dtype.itemsize
    cache_bytes = batch * context * kv_bytes_per_token(cfg, dtype)
    return {
        "weight_bytes": weight_bytes,
        "cache_bytes_per_step": round(cache_bytes),
        "bound_tokens_per_s": batch * bandwidth_gbs * 1e9 / (weight_bytes + cache_bytes),
    }


def step_kernels(model: T6, prompt: torch.Tensor) -> str:
    """The attention kernels of one decode step as the last generation ran it (common.attention_kernels): its
    fixed-shape decoder's step called eagerly once (what its graph replays; compiled, FlexAttention where the
    decoder's caches say so), or an eager step against small caches."""
    device = prompt.device
    with torch.no_grad():
        for decoder in model.static_decoders.values():
            pos = decoder.pos.clone()  # the step advances its position: a copy, so the decoder's own stays
            return attention_kernels(lambda: model.decode_step(decoder.tokens, pos, decoder.caches), device)
        caches = model.build_kv_caches(prompt.shape[0], 2)
        model(prompt[:, :1], 0, caches)
        return attention_kernels(lambda: model(prompt[:, :1], 1, caches), device)


def measure_model(
    name: str,
    cfg: ModelConfig,
    prompt_lengths: list[int],
    batches: list[int],
    *,
    new_tokens: int,
    device: str,
    dtype: torch.dtype,
    step: str,
    rounds: int,
    bandwidth_gbs: float,
) -> list[dict]:
    """The records of one mechanism (see `measure`)."""
    model = random_model(cfg, device, dtype)
    rows = []
    for T0 in prompt_lengths:
        for batch in batches:
            prompt = torch.randint(0, cfg.vocab_size, (batch, T0), device=device)  # [B, T0]

            def generate(n: int, prompt=prompt) -> None:
                model.generate(prompt, n, temperature=0, decode=step)

            for _ in range(2):  # warm up: the first compiles and captures the static step's graphs
                generate(new_tokens + 1)
            prefills, per_token = [], []
            for _ in range(rounds):  # a prefill, then the same prefill and the decode steps
                prefills.append(time_call(lambda: generate(1), 1, device))
                per_token.append((time_call(lambda: generate(new_tokens + 1), 1, device) - prefills[-1]) / new_tokens)
            prefill, per_token = median(prefills), median(per_token)
            if per_token <= 0:
                raise RuntimeError(
                    f"{name}, prompt {T0}, batch {batch}: decoding measured no time against the prefill's "
                    "variation; give more --new-tokens or --rounds"
                )
            row = {
                "attention": name,
                "prompt": T0,
                "batch": batch,
                "new_tokens": new_tokens,
                "step": "static" if model.static_decoders else "eager",
                "kernel": step_kernels(model, prompt),
                "graph": any(bool(d.run.captured) for d in model.static_decoders.values()),
                "n_head": cfg.n_head,
                "prefill_ms": 1e3 * prefill,
                "ms_per_token": 1e3 * per_token,
                "tokens_per_s": batch / per_token,
                **bound(cfg, dtype, batch, T0 + new_tokens / 2, bandwidth_gbs),
            }
            row["fraction_of_bound"] = row["tokens_per_s"] / row["bound_tokens_per_s"]
            rows.append(row)
            model.static_decoders.clear()  # its caches: the next batch gets its own
    return rows


def measure(
    configs: dict[str, ModelConfig],
    prompt_lengths: list[int],
    batches: list[int],
    *,
    new_tokens: int = 64,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    step: str = "auto",
    rounds: int = 3,
    bandwidth_gbs: float,
    verbose: bool = True,
    on_records=None,
) -> list[dict]:
    """One record per mechanism, prompt length and batch: prefill time, decode ms/token and tokens/s (all
    rows), the bound and the fraction of it reached; each time the median of `rounds`, after two warm-up
    generations (the first captures the static step's graphs). The mechanisms run one after another;
    on_records(records so far) is called after each."""
    records = []
    for name, cfg in configs.items():
        rows = measure_model(
            name,
            cfg,
            prompt_lengths,
            batches,
            new_tokens=new_tokens,
            device=device,
            dtype=dtype,
            step=step,
            rounds=rounds,
            bandwidth_gbs=bandwidth_gbs,
        )
        if any(r["step"] == "static" for r in rows):
            torch.compiler.reset()  # frees this mechanism's graphs (and CUDA graph memory) for the next one
        if verbose:
            print(table(rows, COLUMNS), flush=True)
            print()
        records += rows
        if on_records is not None:
            on_records(records)
    return records


COLUMNS = [
    ("attention", "attention", ""),
    ("prompt", "prompt", "d"),
    ("batch", "batch", "d"),
    ("step", "step", ""),
    ("kernel", "attention kernel", ""),
    ("graph", "CUDA graph", ""),
    ("n_head", "heads", "d"),
    ("prefill_ms", "prefill ms", ".1f"),
    ("ms_per_token", "ms/token", ".3f"),
    ("tokens_per_s", "tokens/s", ".1f"),
    ("bound_tokens_per_s", "bound tokens/s", ".1f"),
    ("fraction_of_bound", "of bound", ".3f"),
]


def run(args) -> dict:
    prompt_lengths, batches = ints(args.prompt_lengths), ints(args.batches)
    configs = model_configs(args.attentions, args.size, block_size=max(prompt_lengths) + args.new_tokens + 1)
    bw = args.bandwidth_gbs or copy_bandwidth_gbs(args.device, 1024 if args.device.startswith("cuda") else 256)
    print(f"bandwidth: {bw:.1f} GB/s ({'given' if args.bandwidth_gbs else 'measured copy, read + write'})")

    def result(records: list[dict]) -> dict:
        return harness.result("generate", args.device, records, bandwidth_gbs=bw, size=args.size, dtype=args.dtype)

    records = measure(
        configs,
        prompt_lengths,
        batches,
        new_tokens=args.new_tokens,
        device=args.device,
        dtype=DTYPES[args.dtype],
        step=args.step,
        rounds=args.rounds,
        bandwidth_gbs=bw,
        on_records=lambda records: harness.write_json(args.json, result(records), quiet=True),
    )
    return result(records)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(parser)
    parser.add_argument("--prompt-lengths", default="2k", help="prompt tokens, comma-separated (2k = 2048)")
    parser.add_argument("--batches", default="1", help="sequences generated together, comma-separated")
    parser.add_argument("--new-tokens", type=harness.positive_int, default=64, help="decoded tokens per generation")
    parser.add_argument("--rounds", type=int, default=3, help="timed generations per setting; the median is kept")
    parser.add_argument("--step", default="auto", choices=list(DECODERS), help="generate's decoder (see above)")
    parser.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth (default: measured)")
    return harness.run_main(parser, argv, run, None)


if __name__ == "__main__":
    main()
