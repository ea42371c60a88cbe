"""Training-step throughput of each attention at one size, side by side on this device.

    python -m t6.bench.train_step --size small --seq-len 1024 --batch-size 8 --json bench.json

For every attention the real model of `conf/attention/NAME.yaml` x `conf/size/SIZE.yaml` (its
parameter-matched head count) runs forward + backward + AdamW step on random tokens; after
warm-up steps the median step time gives tokens/s, reported with the ratio to MHA. Each row
also carries the FLOPs per token that FlopCounterMode counts for forward + backward at this
sequence length (`t6.model.facts.flops_per_token`), so achieved FLOP/s and MFU follow from the same
row: MFU against --peak-tflops, else the device's peak from Lightning's table (a GPU it knows) or a
measured matmul (the CPU), named in the output. --compile compiles what training compiles (each
block, T6.compile_blocks), the loss outside.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from t6.bench import harness
from t6.bench.common import median, model_configs, ratios_to_mha, time_call
from t6.bench.harness import DTYPES, common_args, parse
from t6.hardware.device import peak_flops
from t6.model import T6, ModelConfig
from t6.model.attention.tpa import TensorProductAttention
from t6.model.facts import flops_per_token
from t6.model.loss import IMPLS


def bench_one(mcfg: ModelConfig, args: argparse.Namespace, device: str) -> tuple[list[float], int, list[dict]]:
    """Seconds per optimizer step (timed steps only), the parameter count, and with --profile-top N the step's N
    costliest kernels (`top_kernels`)."""
    torch.manual_seed(0)
    model = T6(mcfg).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.startswith("cuda"))
    if args.compile:
        model.compile_blocks(args.compile_backend)  # the region training compiles: each block, the loss outside
    idx = torch.randint(0, mcfg.vocab_size, (args.batch_size, args.seq_len + 1), device=device)
    x, y = idx[:, :-1], idx[:, 1:]  # [B, T] each
    autocast = torch.autocast(torch.device(device).type, dtype=DTYPES[args.dtype], enabled=args.dtype != "float32")

    backends = SDPA_BACKENDS[args.sdpa_backend]

    def step() -> None:
        with autocast, sdpa_kernel(backends) if backends else contextlib.nullcontext():
            loss = model(x, targets=y, loss_chunk_tokens=args.loss_chunk_tokens, loss_impl=args.loss_impl)  # []
        loss.backward()  # the attention's backward kernel is its forward's
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    times = [time_call(step, 1, device) for _ in range(args.steps)]
    top = top_kernels(step, device, args.profile_top) if args.profile_top else []
    return times, model.num_params(), top


# --sdpa-backend: the attention kernels a training step may use (SDPA's own order among them)
SDPA_BACKENDS = {
    "default": None,  # SDPA's own choice, as training
    "flash": [SDPBackend.FLASH_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "math": [SDPBackend.MATH],
}


def top_kernels(step, device: str, n: int) -> list[dict]:
    """One step under torch.profiler: its n costliest kernels on the GPU (on the CPU: ATen operators, by their own
    time), each with its milliseconds in the step and its share of the time of all of them."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize(device)
    if cuda:
        events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
        cost = {e.key: e.self_device_time_total for e in events}
    else:
        cost = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(cost.values()) or 1.0
    ranked = sorted(cost.items(), key=lambda kv: -kv[1])[:n]
    return [{"kernel": name[:120], "ms": us / 1e3, "share": us / total} for name, us in ranked]


def peak(args: argparse.Namespace) -> tuple[float, str]:
    """The device's peak FLOP/s at --dtype for the MFU column: --peak-tflops, else Lightning's table or a
    measured matmul (t6.hardware.device.peak_flops)."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12, "--peak-tflops"
    if args.dtype == "float32" and args.device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # as training runs fp32 on CUDA: TF32, and its peak
    return peak_flops(args.device, DTYPES[args.dtype])


def run(args: argparse.Namespace) -> list[dict]:
    TensorProductAttention.triton_contract = args.triton_contract  # this process's TPA layers, every variant
    peak_flops_s, source = peak(args)
    print(f"MFU against {peak_flops_s / 1e12:.4g} TFLOP/s: {source}", flush=True)
    rows = []
    for attention, mcfg in model_configs(args.attentions, args.size, overrides=args.override).items():
        if args.seq_len > mcfg.block_size:
            raise ValueError(f"--seq-len {args.seq_len} exceeds size.block_size={mcfg.block_size}")
        times, params, top = bench_one(mcfg, args, args.device)
        step = median(times)
        tokens_per_s = args.batch_size * args.seq_len / step
        flops = flops_per_token(mcfg, args.seq_len)
        rows.append(
            {
                "attention": attention,
                "size": args.size,
                "n_head": mcfg.n_head,
                "params": params,
                "device": args.device,
                "dtype": args.dtype,
                "batch_size": args.batch_size,
                "seq_len": args.seq_len,
                "step_ms": step * 1e3,  # median over the timed steps
                "tokens_per_s": tokens_per_s,
                "flops_per_token_train": flops,  # forward + backward, FlopCounterMode
                "achieved_tflops": flops * tokens_per_s / 1e12,
                "mfu": flops * tokens_per_s / peak_flops_s,
                "peak_tflops": peak_flops_s / 1e12,
                "peak_source": source,
                "sdpa_backend": args.sdpa_backend,
                "triton_contract": args.triton_contract,
                **({"top_kernels": top} if top else {}),
            }
        )
        print(f"  {attention}: {step * 1e3:.1f} ms/step", flush=True)
        harness.write_json(args.json, result_of(args, rows), quiet=True)  # a run cut short keeps its rows
    ratios_to_mha(rows, "tokens_per_s", "ratio_to_mha")  # > 1: faster than MHA
    ratios_to_mha(rows, "mfu", "mfu_vs_mha")  # the share of the peak against MHA's: 1 is MHA's efficiency
    for r in rows:
        r["gflops_per_token_train"] = r["flops_per_token_train"] / 1e9
    return rows


COLUMNS = [
    ("attention", "attention", ""),
    ("n_head", "heads", "d"),
    ("params", "params", ","),
    ("step_ms", "ms/step", ".1f"),
    ("tokens_per_s", "tokens/s", ".0f"),
    ("ratio_to_mha", "vs MHA", ".3f"),
    ("gflops_per_token_train", "GFLOP/tok", ".3f"),
    ("achieved_tflops", "TFLOP/s", ".3f"),
    ("mfu", "MFU", ".1%"),
    ("mfu_vs_mha", "MFU vs MHA", ".3f"),
]


def chunk_tokens(text: str) -> int | None:
    return None if text.lower() in ("none", "null") else int(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    common_args(p, size="small", device="auto", dtype="bfloat16")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10, help="timed steps per attention")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument(
        "--compile", action="store_true", help="torch.compile each block, as training does (T6.compile_blocks)"
    )
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile's backend with --compile (aot_eager: dynamo and AOTAutograd without code generation)",
    )
    p.add_argument(
        "--loss-chunk-tokens",
        type=chunk_tokens,
        default=1024,
        help="tokens per chunk of the LM head + cross-entropy, as in training; none: all logits at once",
    )
    p.add_argument(
        "--loss-impl",
        choices=IMPLS,
        default="auto",
        help="the loss as in training: auto (Liger's fused kernel on CUDA, the chunks elsewhere), chunked, liger",
    )
    p.add_argument("--override", action="append", default=[], help="extra Hydra override, e.g. size.n_layer=2")
    p.add_argument(
        "--sdpa-backend",
        choices=sorted(SDPA_BACKENDS),
        default="default",
        help="the attention kernels the step may use (default: SDPA's own choice, as training)",
    )
    p.add_argument(
        "--triton-contract",
        action="store_true",
        help="TPA's Q, K, V contracted by t6::tpa_contract (Triton on CUDA) instead of inductor's fused code",
    )
    p.add_argument(
        "--profile-top",
        type=int,
        default=0,
        help="profile one more step per mechanism and record its N costliest kernels (top_kernels in the JSON)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        help="the device's peak TFLOP/s at --dtype, for the MFU column (default: Lightning's table for a GPU it "
        "knows, else a measured matmul, as on the CPU)",
    )
    return p


def result_of(args: argparse.Namespace, rows: list[dict]) -> dict:
    return harness.result("train_step", args.device, rows, size=args.size, dtype=args.dtype, compile=args.compile)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(parser(), argv)
    rows = run(args)
    harness.finish(result_of(args, rows), COLUMNS, args.json)
    for r in rows:
        for k in r.get("top_kernels", []):
            print(f"  {r['attention']:>10}  {k['ms']:8.3f} ms  {k['share']:6.1%}  {k['kernel']}")
    return rows


if __name__ == "__main__":
    main()
