"""Host time per decode step: what the host spends on one token's step of the whole model, apart from the device's
work, the bound on tokens/s that a faster GPU cannot lift.

    python -m t6.bench.step_overhead --attentions mha,tpa --size medium --json step_overhead.json

Per mechanism, a model of `--size` (random weights) with a fixed-shape decoder (t6.model.static_decode.StaticDecoder,
batch `--batch`, `--context` cached tokens), each step timed on the host over `--steps` consecutive positions:

- `guards_us`: the step compiled by torch.compile (whole, fixed shapes) with a backend that runs nothing (the
  outputs of its first call, returned again): what dynamo adds to every call, its guards over the graph's
  inputs (`graph_inputs`: parameters, caches) and the marshalling, i.e. the host's share of a step that
  torch.compile's "reduce-overhead" mode replays;
- `replay_us`: `StaticDecoder.step` as generation calls it, the step captured once (t6.model.static_decode.FixedStep):
  on CUDA a real CUDA graph, timed until `replay()` returns (the device not waited for); elsewhere a capture
  whose replay runs nothing. Copying the tokens in, the bucket's bookkeeping, one replay: the aim is < 20 us;
- `eager_us`: the eager step's host time, every kernel launched from Python (on the CPU its wall time, the
  device's work included).

Every timed round starts again at `--context` cached tokens: each call of the step advances the position it
writes at, and a cache holds `context + steps + 1` positions.

The wall time of a real step is the larger of its host time and its device time (t6.bench.generate measures the
whole).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from t6.bench import harness
from t6.bench.common import host_time_call, median, model_configs, time_call
from t6.bench.generate import random_model
from t6.model.static_decode import StaticDecoder, bucket


class NullGraphs:
    """A capture (t6.model.static_decode.FixedStep's) whose replay runs nothing: the step runs once, at its capture, and
    every replay returns that output. What remains of a step is the host's part around the replay."""

    @contextlib.contextmanager
    def warmup(self):
        yield

    def __call__(self, run):
        out = run()
        return lambda: out


def run_nothing(inputs: list[int]):
    """A torch.compile backend whose compiled function runs the graph once, then returns that output again without
    running anything; it records the graph's input count in `inputs`."""

    def backend(gm, example_inputs):
        inputs.append(len(example_inputs))
        first: list = []

        def call(*args):
            if not first:
                first.append(gm(*args))
            return first[0]

        return call

    return backend


def host_us(fn, steps: int, device: str) -> float:
    """Microseconds per call of fn on the host: its wall time off CUDA, the time to return on CUDA."""
    timer = host_time_call if device.startswith("cuda") else time_call
    return 1e6 * timer(fn, steps, device)


def measure_one(name: str, cfg, *, batch: int, context: int, steps: int, rounds: int, device: str, dtype) -> dict:
    model = random_model(cfg, device, dtype)
    prompt = torch.randint(0, cfg.vocab_size, (batch, context), device=device)  # [B, context]
    capture = None if device.startswith("cuda") else NullGraphs()
    decoder = StaticDecoder(model, batch, capture=capture)
    tokens = prompt[:, -1:]  # [B, 1]

    def generation():  # steps consecutive positions, as a generation makes them
        for position in range(context, context + steps):
            decoder.step(tokens, position)

    def per_step(fn) -> float:
        """Host microseconds per call of fn (one step, which advances the position), over `steps` calls from
        `context` cached tokens on: every round starts there again, so no call writes past the cache."""
        times = []
        for _ in range(rounds):
            decoder.pos.fill_(context)
            times.append(host_us(fn, steps, device))
        return median(times)

    record = {"attention": name, "batch": batch, "context": context, "n_head": cfg.n_head}
    with torch.no_grad():
        decoder.prefill(prompt)
        generation()  # captures the bucket's step
        record["replay_us"] = median([host_us(generation, 1, device) / steps for _ in range(rounds)])
        length = bucket(context + 1, decoder.max_len)
        for cache in decoder.caches:
            cache.static_len = length
        inputs: list[int] = []
        compiled = torch.compile(decoder.advance, fullgraph=True, dynamic=False, backend=run_nothing(inputs))
        args = (decoder.tokens, decoder.pos, decoder.caches)
        compiled(*args)  # traces (tens of seconds for a deep model), then runs once
        record["graph_inputs"] = inputs[0]
        record["guards_us"] = per_step(lambda: compiled(*args))
        record["eager_us"] = per_step(lambda: decoder.advance(*args))
    torch.compiler.reset()
    return record


COLUMNS = [
    ("attention", "attention", ""),
    ("n_head", "heads", "d"),
    ("batch", "batch", "d"),
    ("context", "context", "d"),
    ("graph_inputs", "graph inputs", "d"),
    ("guards_us", "compiled, guards us/step", ".1f"),
    ("eager_us", "eager us/step", ".1f"),
    ("replay_us", "graph replay us/step", ".1f"),
]


def run(args) -> dict:
    configs = model_configs(args.attentions, args.size, overrides=args.override)
    records = []
    for name, cfg in configs.items():
        context = min(args.context, cfg.block_size - args.steps - 1)
        cfg = dataclasses.replace(cfg, block_size=max(cfg.block_size, context + args.steps + 1))
        records.append(
            measure_one(
                name,
                cfg,
                batch=args.batch,
                context=context,
                steps=args.steps,
                rounds=args.rounds,
                device=args.device,
                dtype=harness.DTYPES[args.dtype],
            )
        )
        print(harness.table(records[-1:], COLUMNS), flush=True)
    return harness.result("step_overhead", args.device, records, size=args.size, dtype=args.dtype)


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    harness.common_args(parser, size="medium", device="auto", dtype="bfloat16")
    parser.set_defaults(attentions="mha,tpa")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1000, help="cached tokens before the first timed step")
    parser.add_argument("--steps", type=int, default=20, help="consecutive steps per timed round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds; the median is kept")
    parser.add_argument("--override", action="append", default=[], help="extra Hydra override, e.g. size.n_layer=2")
    return harness.run_main(parser, argv, run, COLUMNS)


if __name__ == "__main__":
    main()
