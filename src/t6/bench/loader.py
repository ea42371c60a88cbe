"""Loader throughput: `python -m t6.bench.loader [--json PATH] [overrides ...]`.

Measures, in one process, the tokens/s the training DataModule delivers on its own (memmap
windows -> batches) and the tokens/s one training step consumes for the same configuration
(forward + backward + optimizer step of the configured model), and prints both with their ratio:
a ratio far above 1 means the loader never limits training. Overrides are Hydra overrides of
conf/train.yaml (e.g. `size=small data=fineweb_edu`).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import open_dict

from t6.bench import harness
from t6.bench.common import compose
from t6.hydra_config import model_config
from t6.model import T6
from t6.training.optim import param_groups


def _config(overrides: list[str]):
    cfg = compose("train", overrides, runtime=True)
    with open_dict(cfg):
        cfg.paths.output_dir = str(Path(cfg.paths.log_dir) / "bench")
    return cfg


def loader_tokens_per_s(datamodule, batches: int) -> float:
    it = iter(datamodule.train_dataloader())
    next(it)  # open the memmaps
    t0 = time.perf_counter()
    tokens = sum(next(it)[0].numel() for _ in range(batches))
    return tokens / (time.perf_counter() - t0)


def step_tokens_per_s(cfg, datamodule, steps: int) -> float:
    model = T6(model_config(cfg))
    optimizer = instantiate(cfg.optimizer)(param_groups(model, cfg.optimizer.get("weight_decay", 0.0)))
    it = iter(datamodule.train_dataloader())
    batches = [next(it) for _ in range(steps + 1)]

    def step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(*batches[0])  # warm-up
    t0 = time.perf_counter()
    for x, y in batches[1:]:
        step(x, y)
    return sum(b[0].numel() for b in batches[1:]) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    parser.add_argument("--batches", type=int, default=200, help="loader batches to time")
    parser.add_argument("--steps", type=int, default=5, help="training steps to time")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    cfg = _config(args.overrides)
    datamodule = instantiate(cfg.data)
    if datamodule.batch_size == "auto":  # the whole global batch in one step (a benchmark, not a memory plan)
        datamodule.batch_size = datamodule.per_device_batch(1)
        with open_dict(cfg):
            cfg.data.batch_size = datamodule.batch_size
    datamodule.prepare_data()
    datamodule.setup("fit")
    loader = loader_tokens_per_s(datamodule, args.batches)
    train = step_tokens_per_s(cfg, datamodule, args.steps)
    result = {
        "config": " ".join(args.overrides) or "defaults",
        "batch": [cfg.data.batch_size, cfg.data.seq_len],
        "loader_tokens_per_s": loader,
        "train_step_tokens_per_s": train,
        "loader_over_step": loader / train,
    }
    harness.finish(harness.result("loader", "cpu", [result]), COLUMNS, args.json)
    return result


COLUMNS = [
    ("config", "config", ""),
    ("loader_tokens_per_s", "loader alone tokens/s", ",.0f"),
    ("train_step_tokens_per_s", "training step consumes tokens/s", ",.0f"),
    ("loader_over_step", "loader / step", ".1f"),
]


if __name__ == "__main__":
    main()
