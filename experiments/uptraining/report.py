"""Write experiments/uptraining/REPORT.md from the runs of run.sh: final validation loss and the
local zero-/two-shot scores of every run (MLflow), the converted checkpoints' validation loss before
any uptraining (measured here on the same validation windows), tokens trained, KV-cache bytes per
token, and decode tokens/s of each run's attention layer (t6.bench.decode, timed side by side here).

    python experiments/uptraining/report.py --runs logs/uptraining --out experiments/uptraining/REPORT.md
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import mlflow
import torch

from t6.bench.decode import measure
from t6.data.datamodule import TokenDataModule
from t6.model import T6, ModelConfig
from t6.model.facts import kv_bytes_per_token
from t6.model.load import load_model, model_state, read_checkpoint
from t6.model.loss import mean_loss
from t6.uptrain.convert import kv_head_count

ROOT = Path(__file__).resolve().parents[2]


def decode_speeds(configs: list[ModelConfig], contexts: list[int]) -> dict[tuple, dict[int, float]]:
    """Tokens/s of one attention layer decoding at each context, for every distinct attention shape
    among `configs` (keyed by attention, query heads, KV heads), timed interleaved in one run."""
    shapes = {}
    for cfg in configs:
        key = (cfg.attention, cfg.n_head, kv_head_count(cfg))
        shapes.setdefault(key, cfg)
    named = {("mha" if key[0] == "mha" else f"{key[0]}{key[2]}"): (key, cfg) for key, cfg in shapes.items()}
    records = measure(
        {name: cfg for name, (_, cfg) in named.items()}, contexts, steps=50, rounds=7, warmup=20, verbose=False
    )
    speeds: dict[tuple, dict[int, float]] = {}
    for r in records:
        speeds.setdefault(named[r["attention"]][0], {})[r["context"]] = r["tokens_per_s"]
    return speeds


def val_loader(run_config: dict):
    data = dict(run_config["data"])
    data.pop("_target_")
    dm = TokenDataModule(**data)
    dm.prepare_data()
    dm.setup("fit")
    return dm.val_dataloader()


def mlflow_run(client: mlflow.MlflowClient, experiment_id: str, name: str):
    runs = client.search_runs(
        [experiment_id], f"tags.mlflow.runName = '{name}'", order_by=["attributes.start_time DESC"], max_results=1
    )
    return runs[0] if runs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="logs/uptraining")
    ap.add_argument("--out", default="experiments/uptraining/REPORT.md")
    ap.add_argument("--experiment", default="uptraining")
    ap.add_argument("--contexts", default="256,4096", help="decode contexts (cached tokens) for the tokens/s columns")
    ap.add_argument(
        "--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI", f"sqlite:///{ROOT}/mlruns/mlflow.db")
    )
    args = ap.parse_args()
    runs_dir = Path(args.runs)
    client = mlflow.MlflowClient(tracking_uri=args.tracking_uri)
    experiment = client.get_experiment_by_name(args.experiment)
    if experiment is None:
        raise SystemExit(
            f"no MLflow experiment {args.experiment!r} in {args.tracking_uri}; run experiments/uptraining/run.sh first"
        )

    source_path = runs_dir / "mha-scratch/checkpoints/last.ckpt"
    source_ckpt = read_checkpoint(source_path, "source checkpoint")
    loader = val_loader(source_ckpt["run_config"])
    source_cfg, source_state = model_state(source_ckpt, "source checkpoint", source_path)
    mha = T6(source_cfg)
    mha.load_state_dict(source_state)
    source_loss = mean_loss(mha, loader)
    source_tokens = source_ckpt["TokenDataModule"]["samples_seen"] * source_ckpt["run_config"]["data"]["seq_len"]

    rows = []
    done = [p for p in runs_dir.iterdir() if (p / "checkpoints/last.ckpt").is_file()]
    for run_dir in sorted(done, key=lambda p: (p.name != "mha-scratch", p.name)):
        run = mlflow_run(client, experiment.experiment_id, run_dir.name)
        path = run_dir / "checkpoints/last.ckpt"
        ckpt = read_checkpoint(path, "run checkpoint", mmap=True)
        cfg, _ = model_state(ckpt, "run checkpoint", path)
        tokens = ckpt["TokenDataModule"]["samples_seen"] * ckpt["run_config"]["data"]["seq_len"]
        init_from = ckpt["run_config"].get("init_from")
        total = tokens + (source_tokens if init_from else 0)
        metrics = run.data.metrics if run else {}
        scores = [metrics.get("val/loss"), metrics.get("eval/0shot/avg"), metrics.get("eval/2shot/avg")]
        rows.append((run_dir.name, cfg, ckpt["global_step"], tokens, total, scores, run.info.run_id if run else "-"))

    converted = []
    for path in sorted((runs_dir / "converted").glob("*.ckpt")):
        model = load_model(path, what="converted checkpoint")
        converted.append((path.stem, model.cfg, mean_loss(model, loader)))
    torch.manual_seed(0)
    random_loss = mean_loss(T6(ModelConfig(**converted[0][1].__dict__)), loader) if converted else float("nan")

    def kv(cfg: ModelConfig) -> str:
        return f"{kv_bytes_per_token(cfg):,}"  # all layers, bf16 caches, as served

    contexts = [int(c) for c in args.contexts.split(",")]
    speeds = decode_speeds([r[1] for r in rows] + [c[1] for c in converted], contexts)

    def decode(cfg: ModelConfig) -> list[str]:
        return [f"{speeds[(cfg.attention, cfg.n_head, kv_head_count(cfg))][c]:,.0f}" for c in contexts]

    def number(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    lines = [
        "# Uptraining MHA → GQA / MQA at CPU scale",
        "",
        f"Embedded corpus (Tiny Shakespeare, GPT-2 BPE), `size={source_ckpt['run_config']['size']['name']}` "
        f"(d_model={source_cfg.d_model}, {source_cfg.n_layer} layers, "
        f"{source_cfg.n_head} query heads of {source_cfg.head_dim}), "
        f"AdamW, paper LR schedule. "
        f"The MHA source trained {source_ckpt['global_step']} steps = {source_tokens:,} tokens. "
        f"Validation: {len(loader.dataset)} windows of {source_ckpt['run_config']['data']['seq_len']} tokens. "
        f"KV bytes/token: all layers, bf16, from each attention's `cache_spec`. "
        f"0-/2-shot: the local lm-eval task `t6_next_line` (acc_norm, pick the true next line among four), "
        f"evaluated at the end of each run. Decode tok/s: one attention layer of the run's shape decoding one token "
        f"against a cache of {' and '.join(map(str, contexts))} tokens (`t6.bench.decode.measure`, fp32, batch 1, "
        f"all shapes interleaved in one run on this machine, median of 7 rounds of 50 calls). "
        f"Produced by `experiments/uptraining/run.sh`.",
        "",
        "## Runs",
        "",
        "| run | attention | KV heads | steps | tokens (this run) | tokens incl. source | val loss | 0-shot | 2-shot "
        "| KV bytes/token | " + " | ".join(f"decode tok/s @ {c}" for c in contexts) + " | MLflow run |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(contexts) + "---|",
    ]
    for name, cfg, steps, tokens, total, (val, zero, two), run_id in rows:
        lines.append(
            f"| {name} | {cfg.attention} | {kv_head_count(cfg)} | {steps} | {tokens:,} | {total:,} "
            f"| {number(val, '.4f')} | "
            f"{number(zero, '.3f')} | {number(two, '.3f')} | {kv(cfg)} | {' | '.join(decode(cfg))} | `{run_id}` |"
        )
    lines += [
        "",
        "## Converted checkpoints before any uptraining",
        "",
        f"Same validation windows. MHA source: **{source_loss:.4f}**; a randomly initialized model: {random_loss:.4f}.",
        "",
        "| checkpoint | attention | KV heads | val loss | gap to source | KV bytes/token |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, cfg, loss in converted:
        lines.append(
            f"| {name} | {cfg.attention} | {kv_head_count(cfg)} | {loss:.4f} | {loss - source_loss:+.4f} | {kv(cfg)} |"
        )
    lines.append("")
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
