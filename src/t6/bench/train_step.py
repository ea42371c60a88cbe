"""Training-step throughput of each attention at one size, side by side on this device.

    python -m t6.bench.train_step --size small --seq-len 1024 --batch-size 8 --json bench.json

For every attention the real model of `conf/attention/NAME.yaml` x `conf/size/SIZE.yaml` (its
parameter-matched head count) runs forward + backward + AdamW step on random tokens; after
warm-up steps the median step time gives tokens/s, reported with the ratio to MHA. Each row
also carries the FLOPs per token that FlopCounterMode counts for forward + backward at this
sequence length, so achieved FLOP/s (and MFU against a peak) follow from the same row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from t6.config import model_config
from t6.model import T6, ModelConfig
from t6.perf import flops_per_token
from t6.model.facts import meta_model

DEFAULT_ATTENTIONS = "mha,mqa,gqa,mla,tpa_kvonly,tpa"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Row:
    attention: str
    size: str
    n_head: int
    params: int
    device: str
    dtype: str
    batch_size: int
    seq_len: int
    step_ms: float  # median over the timed steps
    tokens_per_s: float
    flops_per_token_train: float  # forward + backward, FlopCounterMode
    achieved_tflops: float  # flops_per_token_train x tokens_per_s / 1e12
    ratio_to_mha: float | None = None  # tokens/s relative to MHA (> 1: faster)
    mfu: float | None = None  # achieved / --peak-tflops (model FLOPs utilization)


def conf_dir() -> Path:
    """conf/ of the project: beside src/ in a checkout, else under the working directory."""
    here = Path(__file__).resolve().parents[3] / "conf"
    return here if here.is_dir() else Path.cwd() / "conf"


def model_cfg(attention: str, size: str, overrides: list[str]) -> ModelConfig:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(config_name="summary", overrides=[f"attention={attention}", f"size={size}", *overrides])
    return model_config(cfg)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_one(mcfg: ModelConfig, args: argparse.Namespace, device: torch.device) -> tuple[list[float], int]:
    """Seconds per optimizer step (timed steps only) and the parameter count."""
    torch.manual_seed(0)
    model = T6(mcfg).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    step_fn = torch.compile(model) if args.compile else model
    idx = torch.randint(0, mcfg.vocab_size, (args.batch_size, args.seq_len + 1), device=device)
    x, y = idx[:, :-1], idx[:, 1:]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    times = []
    for step in range(args.warmup + args.steps):
        sync(device)
        start = time.perf_counter()
        with autocast:
            loss = step_fn(x, targets=y, loss_chunk_tokens=args.loss_chunk_tokens)  # [] (t6.model.loss)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    params = model.num_params()
    del model, opt
    return times, params


def run(args: argparse.Namespace) -> list[Row]:
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    for attention in args.attentions.split(","):
        mcfg = model_cfg(attention, args.size, args.override)
        if args.seq_len > mcfg.block_size:
            raise ValueError(f"--seq-len {args.seq_len} exceeds size.block_size={mcfg.block_size}")
        times, params = bench_one(mcfg, args, device)
        step = statistics.median(times)
        tokens_per_s = args.batch_size * args.seq_len / step
        flops = flops_per_token(meta_model(mcfg), args.seq_len)
        rows.append(Row(attention, args.size, mcfg.n_head, params, str(device), args.dtype, args.batch_size,
                        args.seq_len, step * 1e3, tokens_per_s, flops, flops * tokens_per_s / 1e12))
        print(f"  {attention}: {step * 1e3:.1f} ms/step", flush=True)
    mha = next((r for r in rows if r.attention == "mha"), None)
    for r in rows:
        r.ratio_to_mha = r.tokens_per_s / mha.tokens_per_s if mha else None
        r.mfu = r.achieved_tflops / args.peak_tflops if args.peak_tflops else None
    return rows


def table(rows: list[Row]) -> str:
    head = f"{'attention':<16}{'heads':>6}{'params':>10}{'ms/step':>10}{'tokens/s':>12}{'vs MHA':>8}{'GFLOP/tok':>11}{'TFLOP/s':>9}{'MFU':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = f"{r.ratio_to_mha:.3f}" if r.ratio_to_mha is not None else "-"
        lines.append(
            f"{r.attention:<16}{r.n_head:>6}{r.params / 1e6:>9.1f}M{r.step_ms:>10.1f}{r.tokens_per_s:>12.0f}"
            f"{ratio:>8}{r.flops_per_token_train / 1e9:>11.3f}{r.achieved_tflops:>9.3f}"
            f"{(f'{r.mfu:.1%}' if r.mfu is not None else '-'):>7}"
        )
    return "\n".join(lines)


def chunk_tokens(text: str) -> int | None:
    return None if text.lower() in ("none", "null") else int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", default="small", help="conf/size option")
    p.add_argument("--attentions", default=DEFAULT_ATTENTIONS, help="comma-separated conf/attention options")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10, help="timed steps per attention")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="autocast dtype (float32: none)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--loss-chunk-tokens", type=chunk_tokens, default=1024,
                   help="tokens per chunk of the LM head + cross-entropy, as in training; none: all logits at once")
    p.add_argument("--override", action="append", default=[], help="extra Hydra override, e.g. size.n_layer=2")
    p.add_argument("--peak-tflops", type=float, help="the device's peak TFLOP/s at --dtype, for the MFU column "
                   "(e.g. 989 for an H100 SXM in bf16, 312 for an A100)")
    p.add_argument("--json", type=Path, help="write the rows here as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    rows = run(args)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return rows


if __name__ == "__main__":
    main()
