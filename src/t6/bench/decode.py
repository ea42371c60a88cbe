"""Decode speed: tokens/s of single-token decoding against a KV cache filled to each context length.

    python -m t6.bench.decode --attentions paper --size medium \\
        --contexts 1k,2k,4k,8k,16k,32k --json results/decode.json

What is measured (default `--scope attention`): one attention layer of the chosen width with
parameter-matched head counts, batch `--batch`, decoding one new token at position `context`
against a cache holding `context` earlier tokens: the Q/K/V (or factor) projections, the
in-place cache write, attention over context + 1 tokens and the output projection. This is
the per-layer cost of decoding at long context, the part that grows with the context; the
cache is filled with random values (the arithmetic does not depend on them). `--scope block`
adds the RMSNorms and the SwiGLU feed-forward of the same decoder block (a cost that does not
grow with the context). The mechanisms are timed interleaved, round by round, at each context,
and the median round is reported; ratios are to MHA measured in the same run (MHA's
K/V cache is head-major, the layout SDPA reads fastest). On CUDA each row also gives the GPU
time per token (the kernels' durations, torch.profiler): a wall time far above it is the host's.

`--step` chooses the step timed, as generation runs it (`T6.generate`): `eager` calls the layer
with views that grow with the context (the CPU's path: the fused C++ decode operators); `static`
runs it for fixed shapes over the cache-length bucket of the context (t6.model.static_decode), on CUDA
captured as a CUDA graph and replayed; `compiled` compiles that step with inductor before its capture;
`auto` (default) is static on CUDA, eager elsewhere. Each row names the attention kernel the step ran (the
fused operator and what implements it, SDPA's backend, FlexAttention: `attention_kernel`, from the profiler) and
whether the step was replayed as a CUDA graph.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from t6.bench import harness
from t6.bench.common import (
    attention_kernels,
    gpu_time_call,
    layer_kv_bytes_per_token,
    median,
    model_configs,
    ratios_to_mha,
    time_call,
)
from t6.bench.harness import DTYPES, common_args, ints, layer_args, parse, table, write_json
from t6.model.attention import REFERENCE
from t6.model.facts import decode_flops_per_cached_token
from t6.model.static_decode import CudaGraphs, FixedStep, bucket, compile_step
from t6.model.t6 import Block


def machine_limits(seconds: float = 0.5) -> tuple[float, float]:
    """(copy bandwidth GB/s, fp32 matmul GFLOP/s) of this CPU with the current thread count,
    the best of a few repetitions (a 256 MiB copy counts its read and its write)."""
    src = torch.randn(64 * 1024 * 1024)
    dst = torch.empty_like(src)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    bw = max(2 * src.numel() * 4 / time_call(lambda: dst.copy_(src), 3, "cpu") for _ in range(3)) / 1e9
    flops = max(2 * 1024**3 / time_call(lambda: a @ b, 5, "cpu") for _ in range(3)) / 1e9
    return bw, flops


def add_roofline(records: list[dict], bandwidth_gbs: float, peak_gflops: float) -> None:
    """Per record: the time the bytes and FLOPs per cached token allow at this machine's limits
    (max of the two), the fraction of it reached, and the speed-up over MHA the two rooflines allow
    (MHA's roofline time over this one's, at the same context): what `speed_vs_mha` would be with
    both at their bound."""
    for r in records:
        tokens = r["context"] * r["batch"]
        bound = max(
            tokens * r["kv_cache_bytes_per_token"] / (bandwidth_gbs * 1e9),
            tokens * r["flops_per_cached_token"] / (peak_gflops * 1e9),
        )
        r["roofline_ms"] = 1e3 * bound
        r["fraction_of_roofline"] = r["roofline_ms"] / r["ms_per_token"]
    mha = {r["context"]: r["roofline_ms"] for r in records if r["attention"] == REFERENCE}
    for r in records:
        r["roofline_vs_mha"] = mha[r["context"]] / r["roofline_ms"] if r["context"] in mha else None


def build_layer(cfg, scope: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = Block(cfg) if scope == "block" else Block(cfg).attn
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    return layer.to(device=device, dtype=dtype).eval()


def attention_of(layer):
    return layer.attn if isinstance(layer, Block) else layer


STEPS = ("auto", "eager", "static", "compiled")


def resolve_step(step: str, device: str) -> str:
    """--step auto: static on CUDA (a CUDA graph), eager elsewhere (the CPU's fused operators)."""
    return ("static" if str(device).startswith("cuda") else "eager") if step == "auto" else step


def decode_call(layer, step: str, cache, x: torch.Tensor, context: int, max_len: int):
    """The call that decodes x [B, 1, d] at position `context`: the layer itself (step "eager": views growing with
    the context), or its fixed-shape step over the cache bucket of the context (t6.model.static_decode.FixedStep: on
    CUDA captured as a CUDA graph; "compiled": compiled by inductor first). Returns (the call, the same step called
    eagerly once: what the profiler watches for its attention kernel, the FixedStep or None)."""
    pos = torch.tensor([context], device=x.device)  # [1]
    eager = lambda: layer(x, pos, cache)  # noqa: E731
    if step == "eager":
        return eager, eager, None
    cache.static_len = bucket(context + 1, max_len)
    capture = CudaGraphs(x.device) if x.device.type == "cuda" else None
    compiled = compile_step(layer) if step == "compiled" else None
    fixed = FixedStep(layer, (x, pos, cache), [cache], compiled, capture)
    return (lambda: fixed(cache.static_len)), eager, fixed


def measure(
    configs: dict,
    contexts: list[int],
    *,
    batch: int = 1,
    scope: str = "attention",
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    step: str = "eager",
    steps: int = 10,
    rounds: int = 5,
    warmup: int = 3,
    verbose: bool = True,
    on_records=None,
) -> list[dict]:
    """Decode records (one per name and context) for the given name -> ModelConfig, timed
    interleaved round by round; `speed_vs_mha` is filled where a config is named "mha".
    step: "eager", "static" or "compiled" (see the module's docstring)."""
    if step not in STEPS[1:]:
        raise ValueError(f"step={step!r} must be one of {', '.join(STEPS[1:])}")
    max_len = max(contexts) + 1
    layers, caches, info = {}, {}, {}
    for name, cfg in configs.items():
        cfg = dataclasses.replace(cfg, block_size=max(cfg.block_size, max_len))  # RoPE tables reach the context
        layer = build_layer(cfg, scope, device, dtype)
        attn = attention_of(layer)
        cache = attn.build_kv_cache(batch, max_len, dtype, device)
        for t in cache.tensors.values():
            t.normal_()  # a full cache of random keys/values (or factors, latents)
        layers[name], caches[name] = layer, cache
        info[name] = {
            "n_head": cfg.n_head,
            "options": cfg.attention_options,
            "layer_params": sum(p.numel() for p in attn.parameters()),
            "kv_cache_bytes_per_token": layer_kv_bytes_per_token(cfg, dtype),
            "flops_per_cached_token": round(decode_flops_per_cached_token(cfg)),
        }
    records = []
    for context in contexts:
        x = torch.randn(batch, 1, configs[next(iter(configs))].d_model, device=device, dtype=dtype)
        seconds = {name: [] for name in layers}
        with torch.inference_mode():
            planned = {  # the new token sees context + 1 tokens
                name: decode_call(layer, step, caches[name], x, context, max_len) for name, layer in layers.items()
            }
            calls = {name: call for name, (call, _, _) in planned.items()}
            for call in calls.values():  # warm up (and compile, capture)
                time_call(call, warmup, device)
            for _ in range(rounds):
                for name, call in calls.items():
                    seconds[name].append(time_call(call, steps, device))
            gpu = {name: gpu_time_call(call, steps, device) for name, call in calls.items()}
            kernels = {name: attention_kernels(eager, device) for name, (_, eager, _) in planned.items()}
            graphed = {name: fixed is not None and bool(fixed.captured) for name, (_, _, fixed) in planned.items()}
        rows = []
        for name in layers:
            s = median(seconds[name])
            rows.append(
                {
                    "attention": name,
                    "context": context,
                    "batch": batch,
                    "step": step,
                    "kernel": kernels[name],
                    "graph": graphed[name],
                    "cache_view": context + 1 if step == "eager" else caches[name].static_len,
                    "ms_per_token": 1e3 * s,
                    **({} if gpu[name] is None else {"gpu_ms_per_token": 1e3 * gpu[name]}),  # CUDA only
                    "tokens_per_s": batch / s,
                    **info[name],
                }
            )
        ratios_to_mha(rows, "tokens_per_s", "speed_vs_mha")
        if verbose:
            print(table(rows, COLUMNS), flush=True)
            print()
        records += rows
        if on_records is not None:
            on_records(records)  # after each context: a run cut short keeps what it measured
    return records


def run(args) -> dict:
    contexts = ints(args.contexts)
    configs = model_configs(args.attentions, args.size, block_size=max(contexts) + 1)
    if args.bandwidth_gbs and args.peak_tflops:
        bw, peak = args.bandwidth_gbs, 1e3 * args.peak_tflops
    elif args.device == "cpu":
        bw, peak = machine_limits()
    else:
        raise ValueError(
            "--bandwidth-gbs and --peak-tflops are required off the CPU (the device's memory bandwidth and peak)"
        )
    print(f"limits: {bw:.1f} GB/s copy bandwidth, {peak:.1f} GFLOP/s fp32 matmul")

    def result(records: list[dict]) -> dict:
        add_roofline(records, bw, peak)
        fields = dict(bandwidth_gbs=bw, peak_gflops=peak, scope=args.scope, size=args.size, dtype=args.dtype)
        return harness.result("decode", args.device, records, **fields)

    records = measure(
        configs,
        contexts,
        batch=args.batch,
        scope=args.scope,
        device=args.device,
        dtype=DTYPES[args.dtype],
        step=resolve_step(args.step, args.device),
        steps=args.steps,
        rounds=args.rounds,
        warmup=args.warmup,
        verbose=False,  # the table is printed once, with the roofline
        on_records=lambda records: harness.write_json(args.json, result(records), quiet=True),
    )
    print(table(records, COLUMNS + ROOFLINE))
    return result(records)


COLUMNS = [
    ("attention", "attention", ""),
    ("context", "context", "d"),
    ("step", "step", ""),
    ("kernel", "attention kernel", ""),
    ("graph", "CUDA graph", ""),
    ("cache_view", "cache view", "d"),
    ("n_head", "heads", "d"),
    ("layer_params", "layer params", ","),
    ("kv_cache_bytes_per_token", "cache B/token", "d"),
    ("ms_per_token", "ms/token", ".3f"),
    ("gpu_ms_per_token", "GPU ms/token", ".3f"),
    ("tokens_per_s", "tokens/s", ".1f"),
    ("speed_vs_mha", "vs MHA", ".2f"),
]
ROOFLINE = [
    ("flops_per_cached_token", "FLOP/cached token", "d"),
    ("roofline_ms", "roofline ms", ".3f"),
    ("fraction_of_roofline", "of roofline", ".2f"),
    ("roofline_vs_mha", "rooflines allow vs MHA", ".2f"),
]


def summary(records: list[dict]) -> str:
    """Speed ratio to MHA, one row per attention, one column per context."""
    names = list(dict.fromkeys(r["attention"] for r in records))
    contexts = sorted({r["context"] for r in records})
    rows = []
    for name in names:
        row = {"attention": name}
        for r in records:
            if r["attention"] == name:
                row[str(r["context"])] = r["speed_vs_mha"]
        rows.append(row)
    return table(rows, [("attention", "tokens/s vs MHA", "")] + [(str(c), str(c), ".2f") for c in contexts])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(parser)
    layer_args(parser, "1k,2k,4k,8k,16k,32k", "cached tokens before the new one")
    parser.add_argument("--steps", type=int, default=10, help="decode calls per timed round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is reported")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--step",
        default="auto",
        choices=STEPS,
        help="the decode step timed: eager (growing views), static (fixed shapes; a CUDA graph on CUDA), compiled "
        "(static, compiled by inductor first), auto: static on CUDA, eager elsewhere",
    )
    parser.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth (default: measured, CPU)")
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="peak FLOP/s in TFLOP/s (default: measured fp32, CPU)"
    )
    args = parse(parser, argv)
    result = run(args)
    print(summary(result["records"]))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
