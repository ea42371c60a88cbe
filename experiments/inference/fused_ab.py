"""One attention layer's decode step with its fused decode operator and without it (`fused_decode = False`: the
eager form, SDPA for MHA, GQA, MQA and GTA), timed side by side at medium width on the CPU: the way to tell whether
the fused path is the faster on a machine.

    python experiments/inference/fused_ab.py --attentions mha,gqa,mqa,gta --contexts 16k,32k --cpu-time

The two paths alternate, one step each per round; per mechanism and context it prints the median and the best
step of each and their ratio (fused / eager), after checking that both give the same output. `--cpu-time` times
the calling thread's CPU time (one thread): on a machine other jobs load, the time the step ran, not the time it
waited for a core.
"""

import argparse
import time

import torch

from t6.bench.common import median, model_configs, time_call
from t6.bench.decode import build_layer
from t6.bench.harness import attention_names, ints


def cpu_time(fn) -> float:
    """Seconds of the calling thread's CPU time one call of fn takes."""
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attentions", type=attention_names, default=attention_names("mha,gqa,mqa,gta"))
    parser.add_argument("--size", default="medium")
    parser.add_argument("--contexts", type=ints, default=ints("16k,32k"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--cpu-time", action="store_true", help="time by the calling thread's CPU time (1 thread)")
    args = parser.parse_args()
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time measures the calling thread: give --threads 1")
    torch.set_num_threads(args.threads)
    what = "CPU ms of the calling thread" if args.cpu_time else "ms"
    print(f"{args.size}, {args.threads} thread(s), {args.rounds} rounds; {what} per step: fused / eager (fused/eager)")
    for S in args.contexts:
        for name, cfg in model_configs(args.attentions, args.size, block_size=S + 1).items():
            layer = build_layer(cfg, "attention", "cpu", torch.float32)
            if not hasattr(type(layer), "fused_decode"):
                print(f"{name:>10} {S:>6}: no fused decode operator")
                continue
            cache = layer.build_kv_cache(1, S + 1, torch.float32, "cpu")
            for t in cache.tensors.values():
                t.normal_()  # a full cache of random values
            x, pos = torch.randn(1, 1, cfg.d_model), torch.tensor([S])

            def step(fused: bool) -> torch.Tensor:
                layer.fused_decode = fused
                cache.expect(pos, S + 1)
                return layer(x, pos, cache)  # [1, 1, d_model]

            with torch.inference_mode():
                torch.testing.assert_close(step(True), step(False), rtol=1e-4, atol=1e-5, msg=f"{name} at {S}")
                times = {True: [], False: []}
                for _ in range(args.rounds):
                    for fused in (True, False):
                        call = lambda fused=fused: step(fused)  # noqa: E731
                        times[fused].append(1e3 * (cpu_time(call) if args.cpu_time else time_call(call, 1, "cpu")))
            (m1, m0), (b1, b0) = (median(times[f]) for f in (True, False)), (min(times[f]) for f in (True, False))
            medians = f"median {m1:7.2f} / {m0:7.2f} ({m1 / m0:.2f})"
            print(f"{name:>10} {S:>6}: {medians}, best {b1:7.2f} / {b0:7.2f} ({b1 / b0:.2f})")


if __name__ == "__main__":
    main()
