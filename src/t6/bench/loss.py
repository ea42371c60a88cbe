"""Training-step time and peak memory of the plain LM head + cross-entropy against the chunked one.

    python -m t6.bench.loss --size tiny --batch-size 8 --seq-len 256 --chunks none,4096,1024,256
    python -m t6.bench.loss --size medium --batch-size 12 --seq-len 1024 --dtype bfloat16 --chunks none,1024,liger

Each setting of `--chunks` (`none`: all [tokens x vocab] logits at once, as F.cross_entropy
on the head's output; a number: t6.model.loss in chunks of that many tokens; `liger`:
Liger-Kernel's fused linear cross-entropy, training's default on CUDA) trains the same
model (forward + backward + AdamW) in its own fresh process, so the peak memory of one does
not hide another's: the process's peak resident memory on CPU (VmHWM, which includes the
model, optimizer state and the Python runtime), torch.cuda.max_memory_allocated on CUDA.
The processes run one after another in this one invocation, so their times compare.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from t6.bench import harness
from t6.bench.common import model_config_of
from t6.bench.harness import DTYPES, resolve_device
from t6.bench.train_step import bench_one, chunk_tokens
from t6.hardware.probes import peak_rss


def setting(text: str) -> int | str | None:
    """One --chunks entry: none, a number of tokens, or liger."""
    return "liger" if text.lower() == "liger" else chunk_tokens(text)


def measure(args: argparse.Namespace, chunk: int | str | None) -> dict:
    """One setting, in this process: median step time and peak memory."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(resolve_device(args.device))
    mcfg = model_config_of(args.attention, args.size, args.override)
    liger = chunk == "liger"  # Liger sizes its own chunks
    run = argparse.Namespace(
        **{
            **vars(args),
            "loss_chunk_tokens": None if liger else chunk,
            "loss_impl": "liger" if liger else "chunked",
            "compile": False,
            "sdpa_backend": "default",  # SDPA's own choice, as training
            "profile_top": 0,
        }
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, _, _ = bench_one(mcfg, run, str(device))
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = peak_rss()
    step = statistics.median(times)
    return {
        "chunk_tokens": "none" if chunk is None else chunk,
        "step_ms": step * 1e3,
        "tokens_per_s": args.batch_size * args.seq_len / step,
        "peak_mib": peak / 2**20,
    }


def run(args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")  # a fresh interpreter per setting: its peak memory is its own
    rows = []
    for chunk in args.chunks:
        # a pool of one: a child that dies raises BrokenProcessPool here instead of leaving us waiting on it
        with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
            row = pool.submit(measure, args, chunk).result()
        rows.append(row)
        print(
            f"  chunks={row['chunk_tokens']}: {row['step_ms']:.0f} ms/step, peak {row['peak_mib']:.0f} MiB", flush=True
        )
    base = rows[0]
    for r in rows:
        r["speedup_vs_first"] = base["step_ms"] / r["step_ms"]
        r["memory_vs_first"] = r["peak_mib"] / base["peak_mib"]
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--attention", default="tpa")
    p.add_argument("--size", default="tiny", help="conf/size option")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument(
        "--chunks",
        type=lambda s: [setting(c) for c in s.split(",")],
        default="none,4096,1024,256",
        help="comma-separated settings; the first is the reference of the ratio columns",
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps per setting")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, ...")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="autocast dtype (float32: none)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--override", action="append", default=[], help="extra Hydra override, e.g. size.n_layer=2")
    p.add_argument("--json", type=Path, help="write the rows here as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    rows = run(args)
    arguments = {k: str(v) for k, v in vars(args).items()}
    harness.finish(harness.result("loss", resolve_device(args.device), rows, args=arguments), COLUMNS, args.json)
    return rows


COLUMNS = [
    ("chunk_tokens", "chunk tokens", ""),
    ("step_ms", "ms/step", ".0f"),
    ("tokens_per_s", "tokens/s", ".0f"),
    ("speedup_vs_first", "speed vs first", ".2f"),
    ("peak_mib", "peak MiB", ".0f"),
    ("memory_vs_first", "memory vs first", ".2f"),
]


if __name__ == "__main__":
    main()
