"""The fused decode operators alone (t6::tpa_decode, t6::latent_decode), as each mechanism calls them:
time per call, the GPU's time and the host's, and the rate at which they read the cache against the
device's copy bandwidth.

    python -m t6.bench.decode_kernels --device cuda --contexts 4k,32k,128k --batches 1,16 \\
        --json results/decode_kernels.json
    python -m t6.bench.decode_kernels --device cuda --contexts 32k,128k --batches 1,16 --sweep

For each mechanism whose single-token cached step runs the operators (MHA, GQA, MQA, GTA; TPA and its
variants; MLA, GLA; the others are skipped), one attention layer of `--size` (its YAML's head count) with a
cache of random values decodes one token at position `context`; the operator calls of that step (GLA: one per
latent head) are recorded with their arguments and timed alone, together:

- `us`: wall microseconds per step's calls (synchronized);
- `gpu_us` (CUDA): the kernels' time, triton.testing.do_bench's median with the L2 cache flushed
  before each run (a cache that fits in L2 would otherwise read faster than memory);
- `host_us` (CUDA): the time the calls take to return without waiting for the GPU (dispatch, Python,
  launches): under 20 us per call is the aim (`host_us / calls`);
- `gbs` and `of_copy_bw`: the bytes of the cache arguments over the GPU time (the wall time on the
  CPU), and their fraction of the copy bandwidth (read + write of a large buffer, measured, or
  `--bandwidth-gbs`);
- `max_abs_err`: against the eager reference in fp32.

`--sweep` (CUDA) times every tuning of a grid (block size, warps, stages, programs per SM) through the
Triton functions directly and marks each row's fastest correct one: what `triton_decode.TUNING` holds
for the shape class.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from t6.bench import harness
from t6.bench.common import copy_bandwidth_gbs, host_time_call, model_configs, time_call
from t6.bench.decode import build_layer
from t6.bench.harness import DTYPES, common_args, ints, table
from t6.model.attention import fused_decode

# operator -> (its Triton kernel's name in triton_decode, its eager reference, its cache arguments)
OPERATORS = {
    torch.ops.t6.tpa_decode.default: ("tpa_decode", fused_decode.reference_tpa_decode, ("a_k", "b_k", "a_v", "b_v")),
    torch.ops.t6.latent_decode.default: ("latent_decode", fused_decode.reference_latent_decode, ("c_kv", "k_rope")),
    torch.ops.t6.gqa_decode.default: ("gqa_decode", fused_decode.reference_gqa_decode, ("k", "v", "k_rope")),
}


@dataclasses.dataclass
class Call:
    """One call of a fused decode operator: the operator and its arguments by name."""

    op: object  # the operator's overload (torch.ops.t6.NAME.default)
    args: dict

    @property
    def kernel(self) -> str:
        return OPERATORS[self.op][0]

    def cache_bytes(self) -> int:
        """The bytes of the cache the call reads: each cache tensor's, once per storage (GTA's keys are a view of
        its values, the tied state)."""
        read: dict[int, int] = {}
        for name in OPERATORS[self.op][2]:
            t = self.args[name]
            if t is not None:
                where = t.untyped_storage().data_ptr()
                read[where] = max(read.get(where, 0), t.numel() * t.element_size())
        return sum(read.values())

    def cached_tokens(self) -> int:
        """S, the cached tokens the call's cache views hold."""
        a = self.args
        return a["a_k"].shape[1] if "a_k" in a else a["c_kv"].shape[1] if "c_kv" in a else a["k"].shape[2]

    def run(self) -> torch.Tensor:
        return self.op(**self.args)

    def reference(self) -> torch.Tensor:
        fp32 = {
            k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in self.args.items()
        }
        return OPERATORS[self.op][1](**fp32)

    def triton(self, tuning) -> torch.Tensor:
        from t6.model.attention import triton_decode

        with torch.cuda.device(self.args["k" if "k" in self.args else "q_b" if "q_b" in self.args else "q_lat"].device):
            return getattr(triton_decode, self.kernel)(**self.args, tuning=tuning)


class Recorder(TorchDispatchMode):
    """Records the fused decode operators' calls (with their arguments) that a block of code makes."""

    def __init__(self):
        super().__init__()
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in OPERATORS:
            names = [a.name for a in func._schema.arguments]
            self.calls.append(Call(func, {**dict(zip(names, args)), **(kwargs or {})}))
        return func(*args, **(kwargs or {}))


def decode_calls(cfg, context: int, batch: int, device: str, dtype: torch.dtype) -> list[Call]:
    """The operator calls of one attention layer's step decoding the token at position `context`
    (its cache holds `context` earlier tokens of random values); empty for a mechanism without them."""
    cfg = dataclasses.replace(cfg, block_size=max(cfg.block_size, context + 1))  # RoPE tables reach the context
    layer = build_layer(cfg, "attention", device, dtype)
    cache = layer.build_kv_cache(batch, context + 1, dtype, device)
    for t in cache.tensors.values():
        t.normal_()
    x = torch.randn(batch, 1, cfg.d_model, device=device, dtype=dtype)
    with torch.inference_mode(), Recorder() as recorder:
        layer(x, torch.tensor([context], device=device), cache)
    return recorder.calls


def gpu_seconds(fn) -> float:
    """The median GPU time of fn in seconds, the L2 cache flushed before each run (triton.testing)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50, return_mode="median") / 1e3


def sweep_grid() -> list:
    """The tunings `--sweep` times: block sizes, warps, stages, and splits (programs per SM, fewest
    tokens per program)."""
    from t6.model.attention.triton_decode import Tuning

    return [
        Tuning(block_s=b, num_warps=w, num_stages=s, waves=v, min_tokens=n)
        for b, w, s, (v, n) in itertools.product(
            (32, 64, 128), (4, 8), (2, 3, 4), ((1, 256), (2, 256), (4, 256), (2, 512))
        )
    ]


def measure_calls(calls: list[Call], device: str, steps: int, bandwidth: float) -> dict:
    """The timings of a step's calls (see the module's docstring)."""
    step = lambda: [c.run() for c in calls]  # noqa: E731
    nbytes = sum(c.cache_bytes() for c in calls)
    with torch.inference_mode():
        step()
        wall = time_call(step, steps, device)
        gpu = gpu_seconds(step) if device.startswith("cuda") else None
        host = host_time_call(step, steps, device)
        err = max(float((c.run().float() - c.reference()).abs().max()) for c in calls)
    seconds = wall if gpu is None else gpu
    return {
        "calls": len(calls),
        "cache_bytes": nbytes,
        "us": 1e6 * wall,
        **({} if gpu is None else {"gpu_us": 1e6 * gpu, "host_us": 1e6 * host}),  # CUDA only
        "gbs": nbytes / seconds / 1e9,
        "of_copy_bw": nbytes / seconds / 1e9 / bandwidth,
        "max_abs_err": err,
    }


def sweep_calls(calls: list[Call], bandwidth: float, tolerance: float) -> list[dict]:
    """Each tuning of the grid on the step's calls through the Triton kernels: GPU time, bandwidth
    fraction, error; `best` marks the fastest within `tolerance` of the reference."""
    from t6.model.attention.triton_decode import TUNING

    nbytes = sum(c.cache_bytes() for c in calls)
    references = [c.reference() for c in calls]
    table_tunings = set(TUNING.values())
    rows = []
    with torch.inference_mode():
        for tuning in sweep_grid():
            t = tuning
            row = {"tuning": f"{t.block_s}/{t.num_warps}/{t.num_stages}/{t.waves}/{t.min_tokens}"}
            row["in_table"] = tuning in table_tunings
            try:
                step = lambda: [c.triton(tuning) for c in calls]  # noqa: E731, B023
                err = max(float((out.float() - ref).abs().max()) for out, ref in zip(step(), references))
                seconds = gpu_seconds(step)
            except Exception as e:  # a tuning the GPU cannot run (out of shared memory or registers)
                rows.append({**row, "error": f"{type(e).__name__}: {str(e)[:80]}"})
                continue
            rows.append(
                {
                    **row,
                    "gpu_us": 1e6 * seconds,
                    "of_copy_bw": nbytes / seconds / 1e9 / bandwidth,
                    "max_abs_err": err,
                }
            )
    ok = [r for r in rows if "gpu_us" in r and r["max_abs_err"] <= tolerance]
    if ok:
        min(ok, key=lambda r: r["gpu_us"])["best"] = True
    return rows


COLUMNS = [
    ("attention", "attention", ""),
    ("kernel", "operator", ""),
    ("dtype", "dtype", ""),
    ("batch", "batch", "d"),
    ("context", "context", "d"),
    ("calls", "calls", "d"),
    ("cache_bytes", "cache bytes", ","),
    ("us", "us", ".1f"),
    ("gpu_us", "GPU us", ".1f"),
    ("host_us", "host us", ".1f"),
    ("gbs", "GB/s", ".1f"),
    ("of_copy_bw", "of copy BW", ".2f"),
    ("max_abs_err", "max err", ".1e"),
    ("within_tolerance", "within tolerance", ""),
]
SWEEP_COLUMNS = [
    ("attention", "attention", ""),
    ("batch", "batch", "d"),
    ("context", "context", "d"),
    ("tuning", "block/warps/stages/waves/min tokens", ""),
    ("in_table", "in table", ""),
    ("gpu_us", "GPU us", ".1f"),
    ("of_copy_bw", "of copy BW", ".2f"),
    ("max_abs_err", "max err", ".1e"),
    ("best", "best", ""),
    ("error", "error", ""),
]


def run(args) -> dict:
    if args.sweep and not args.device.startswith("cuda"):
        raise ValueError(f"--sweep times the Triton kernels: it needs --device cuda (got --device {args.device})")
    contexts = ints(args.contexts)
    configs = model_configs(args.attentions, args.size)
    bandwidth = args.bandwidth_gbs or copy_bandwidth_gbs(args.device, 1024 if args.device.startswith("cuda") else 256)
    print(f"copy bandwidth: {bandwidth:.1f} GB/s ({'given' if args.bandwidth_gbs else 'measured'})")
    records, sweeps = [], []
    result = harness.result(
        "decode_kernels", args.device, records, size=args.size, copy_bandwidth_gbs=bandwidth, sweep=sweeps
    )
    dtypes = args.dtypes.split(",") if args.dtypes else [args.dtype]
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        tolerance = 1e-2 if dtype == torch.float32 else 5e-2  # TF32 dots in fp32; bf16/fp16 rounding otherwise
        fused = {name: cfg for name, cfg in configs.items() if decode_calls(cfg, 2, 1, args.device, dtype)}
        if len(fused) < len(configs):
            print(f"skipped (no fused decode operator): {', '.join(n for n in configs if n not in fused)}")
        for name, cfg in fused.items():
            for batch in ints(args.batches):
                for context in contexts:
                    calls = decode_calls(cfg, context, batch, args.device, dtype)
                    where = {
                        "attention": name,
                        "kernel": calls[0].kernel,
                        "dtype": dtype_name,
                        "batch": batch,
                        "context": context,
                    }
                    record = {**where, **measure_calls(calls, args.device, args.steps, bandwidth)}
                    record["within_tolerance"] = record["max_abs_err"] <= tolerance
                    records.append(record)
                    print(table(records[-1:], COLUMNS), flush=True)
                    if args.sweep:
                        rows = [{**where, **r} for r in sweep_calls(calls, bandwidth, tolerance)]
                        print(table(rows, SWEEP_COLUMNS), flush=True)
                        sweeps += rows
                    del calls  # the layer's cache goes with them
                    harness.write_json(args.json, result, quiet=True)
    return result


def main(argv=None) -> dict:
    parser = harness.parser(__doc__)
    common_args(parser, device="auto", dtype="bfloat16")
    parser.set_defaults(attentions="mha,mqa,gqa,gta,tpa,tpa_kvonly,mla,gla")
    parser.add_argument("--dtypes", default=None, help="cache dtypes, comma-separated (default: --dtype)")
    parser.add_argument("--contexts", default="4k,32k,128k", help="cached tokens before the new one")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--steps", type=int, default=20, help="timed calls (wall and host time)")
    parser.add_argument("--sweep", action="store_true", help="time every tuning of a grid (CUDA)")
    parser.add_argument("--bandwidth-gbs", type=float, default=None, help="copy bandwidth (default: measured)")
    return harness.run_main(parser, argv, run, COLUMNS)


if __name__ == "__main__":
    main()
