"""Uptraining (Ainslie et al. 2023, "GQA", §2.1): turn a multi-head checkpoint into a
grouped-query or multi-query one, then continue training it as a warm start.

Conversion keeps every weight except the key and value projections: the embedding, the
norms, the SwiGLU, the query and output projections are copied; the h K (and V) heads of
each layer are split into G contiguous groups of h/G heads (query head i reads KV head
i // (h/G), as SDPA's `enable_gqa` broadcasts them) and each group becomes one head:

    W_K [h * d_h, d_model] -> view [G, h/G, d_h, d_model] -> mean over h/G -> [G * d_h, d_model]

(`method="first"` keeps the first head of each group instead, the paper's comparison).
G = h reproduces the MHA exactly; G = 1 is MQA. RoPE acts on each head after the linear
map, identically for every head, so pooling the weights pools the rotated keys.

A converted checkpoint is a warm-start checkpoint: plain tensors and data only, loaded
with `torch.load(weights_only=True)`, holding the T6 state dict, the target ModelConfig
as a dict, and where it came from (the source's MLflow run id, checkpoint and the tokens
it was trained on). `python train.py init_from=PATH` trains from it with a fresh
optimizer, schedule, step count and MLflow run.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from t6.model import T6, ModelConfig
from t6.model.facts import meta_model
from t6.model.load import WARM_START_FORMAT, check_weights, read_checkpoint

TARGETS = ("gqa", "mqa")
METHODS = ("mean", "first")


def pool_heads(weight: torch.Tensor, n_head: int, groups: int, method: str = "mean") -> torch.Tensor:
    """A K or V projection weight [n_head * d_h, d_model] -> [groups * d_h, d_model], one head per group."""
    if method not in METHODS:
        raise ValueError(f"method={method!r}: choose one of {list(METHODS)}")
    if n_head % groups:
        raise ValueError(f"target_kv_heads={groups} does not divide the source's {n_head} heads")
    rows, d_model = weight.shape
    heads = weight.view(groups, n_head // groups, rows // n_head, d_model)  # [G, h/G, d_h, d_model]
    pooled = heads.mean(dim=1) if method == "mean" else heads[:, 0]  # [G, d_h, d_model]
    return pooled.reshape(groups * (rows // n_head), d_model)  # [G * d_h, d_model]


def target_config(source: ModelConfig, target: str, kv_heads: int | None) -> ModelConfig:
    """The converted model's config: the source's shape with `target` attention and kv_heads KV heads."""
    if source.attention != "mha":
        raise ValueError(
            f"the source checkpoint's attention is {source.attention!r}; uptraining converts an 'mha' checkpoint "
            "(train one with attention=mha)"
        )
    if target not in TARGETS:
        raise ValueError(f"target={target!r}: choose one of {list(TARGETS)}")
    if target == "mqa":
        if kv_heads not in (None, 1):
            raise ValueError(f"target=mqa has one KV head; drop target_kv_heads={kv_heads} or use target=gqa")
        options: dict[str, Any] = {}
    else:
        if not isinstance(kv_heads, int) or kv_heads <= 0:
            raise ValueError(f"target=gqa needs target_kv_heads=G, a positive integer (got {kv_heads!r})")
        if source.n_head % kv_heads:
            divisors = [g for g in range(1, source.n_head + 1) if source.n_head % g == 0]
            raise ValueError(
                f"target_kv_heads={kv_heads} does not divide the source's n_head={source.n_head}; choose one of {divisors}"
            )
        options = {"n_kv_head": kv_heads}
    fields = asdict(source)
    fields.update(attention=target, attention_options=options)
    return ModelConfig(**fields)


def convert_state_dict(
    state: dict[str, torch.Tensor], source: ModelConfig, target: ModelConfig, method: str = "mean"
) -> dict[str, torch.Tensor]:
    """Map a T6 state dict from the source (MHA) config to the target (GQA/MQA) config."""
    groups = meta_model(target).blocks[0].attn.n_kv
    out = {}
    for name, tensor in state.items():
        if name.endswith((".attn.k.weight", ".attn.v.weight")):
            out[name] = pool_heads(tensor, source.n_head, groups, method).clone()
        else:
            out[name] = tensor.clone()
    return out


def load_training_checkpoint(path: str | Path) -> dict:
    """A Lightning checkpoint written by train.py, read with weights_only=True."""
    path = Path(path)
    ckpt = read_checkpoint(path, "ckpt_path")  # missing or corrupted: an error naming the file
    if ckpt.get("format") == WARM_START_FORMAT:
        raise ValueError(f"{path} is already a converted (warm-start) checkpoint; convert the MHA training checkpoint")
    if "model_config" not in ckpt.get("hyper_parameters", {}) or "state_dict" not in ckpt:
        raise ValueError(f"{path} is not a T6 training checkpoint (no hyper_parameters.model_config / state_dict)")
    return ckpt


def source_tokens(ckpt: dict) -> dict[str, int | None]:
    """Training tokens behind a Lightning checkpoint: samples seen (steps x global batch) x seq_len.
    None where the checkpoint does not record them (no data-module state and no run config)."""
    run = ckpt.get("run_config") or {}
    data, trainer = run.get("data", {}), run.get("trainer", {})
    seq_len = int(data.get("seq_len") or ckpt["hyper_parameters"]["model_config"]["block_size"])
    samples = (ckpt.get("TokenDataModule") or {}).get("samples_seen")
    if samples is None and data.get("batch_size") and "global_step" in ckpt:  # steps x global batch
        devices = trainer.get("devices", 1)
        samples = int(ckpt["global_step"]) * int(data.get("global_batch_size") or data["batch_size"] * (devices if isinstance(devices, int) else 1))
    return {"steps": ckpt.get("global_step"), "samples": samples, "seq_len": seq_len,
            "tokens": None if samples is None else int(samples) * seq_len}


def convert_checkpoint(
    ckpt_path: str | Path, target: str, target_kv_heads: int | None = None, method: str = "mean", out: str | Path | None = None
) -> dict:
    """Convert an MHA training checkpoint; returns the warm-start checkpoint and writes it to `out` when given."""
    ckpt = load_training_checkpoint(ckpt_path)
    source_cfg = ModelConfig(**ckpt["hyper_parameters"]["model_config"])
    prefix = "model."
    state = {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    check_weights(state, source_cfg, f"source checkpoint {ckpt_path}")
    cfg = target_config(source_cfg, target, target_kv_heads)
    new_state = convert_state_dict(state, source_cfg, cfg, method)
    check_weights(new_state, cfg, "converted model")
    result = {
        "format": WARM_START_FORMAT,
        "state_dict": new_state,
        "model_config": asdict(cfg),
        "conversion": {"target": target, "kv_heads": meta_model(cfg).blocks[0].attn.n_kv, "method": method},
        "source": {
            "ckpt_path": str(Path(ckpt_path).resolve()),
            "mlflow_run_id": ckpt.get("mlflow_run_id"),
            "attention": source_cfg.attention,
            "n_head": source_cfg.n_head,
            **source_tokens(ckpt),
        },
        "source_run_config": ckpt.get("run_config") or {},
    }
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        torch.save(result, out)
    return result


def load_warm_start(path: str | Path) -> dict:
    """A converted checkpoint for `init_from`, checked: the format, and weights that fit its model config."""
    path = Path(path)
    ckpt = read_checkpoint(path, "init_from")
    if ckpt.get("format") != WARM_START_FORMAT:
        raise ValueError(
            f"init_from={str(path)!r} is not a warm-start checkpoint (write one with `python convert.py`); "
            "to resume a training checkpoint use ckpt_path="
        )
    cfg = ModelConfig(**ckpt["model_config"])
    check_weights(ckpt["state_dict"], cfg, f"init_from={path}")
    return ckpt


MODEL_FIELDS = ("vocab_size", "block_size", "n_layer", "d_model", "n_head", "head_dim", "ffn_hidden")


def adopt_model_config(cfg, model_cfg: dict) -> list[str]:
    """Write a warm start's model shape into the composed config (size.* and attention.name/options),
    so the run trains, logs and tags the model it really is. Returns the fields that changed."""
    from omegaconf import open_dict

    changed = []
    with open_dict(cfg):
        for name in MODEL_FIELDS:
            if name == "ffn_hidden" and cfg.size.get(name) is None and model_cfg[name] == int(8 * model_cfg["d_model"] / 3):
                continue  # null means the default width, which the checkpoint has
            if cfg.size.get(name) != model_cfg[name]:
                changed.append(f"size.{name}: {cfg.size.get(name)} -> {model_cfg[name]}")
                cfg.size[name] = model_cfg[name]
        options = dict(model_cfg["attention_options"])
        current = dict(cfg.attention.get("options") or {})
        if cfg.attention.name != model_cfg["attention"] or current != options:
            changed.append(f"attention: {cfg.attention.name} {current} -> {model_cfg['attention']} {options}")
            cfg.attention.name = model_cfg["attention"]
            cfg.attention.options = options
    from t6.config import model_config

    built = asdict(model_config(cfg))
    differ = [f"{k}={model_cfg.get(k)!r} (the config gives {v!r})" for k, v in built.items() if model_cfg.get(k) != v]
    if differ:
        raise ValueError("init_from: the converted model's config cannot be expressed by size/attention: " + ", ".join(differ))
    return changed


@lru_cache(maxsize=16)
def _warm_start_meta(path: str, mtime: float) -> dict:
    """A converted checkpoint's `source` and `source_run_config`, loaded once per file version
    (the uptrain recipe's resolvers read both while the config is composed)."""
    ckpt = read_checkpoint(path, "init_from", mmap=True)
    return {"source": ckpt["source"], "run_config": ckpt.get("source_run_config") or {}}


def converted_meta(init_from: str, needed_by: str) -> dict:
    """`source` and `run_config` of the converted checkpoint `init_from`, for the recipe value `needed_by`."""
    if not init_from:
        raise ValueError(f"{needed_by} needs init_from=PATH, a checkpoint written by `python convert.py`")
    path = Path(init_from)
    if not path.is_file():
        raise FileNotFoundError(f"init_from={init_from!r} does not exist")
    return _warm_start_meta(str(path.resolve()), path.stat().st_mtime)


def uptrain_steps(init_from: str, fraction: float, batch_size: int, global_batch_size: int | None, devices, seq_len: int) -> int:
    """Optimizer steps that train on `fraction` of the source's tokens at this run's global batch and seq_len."""
    if not 0 < float(fraction):
        raise ValueError(f"uptrain_fraction={fraction} must be positive")
    source = converted_meta(init_from, "uptrain_fraction")["source"]
    if not source.get("tokens"):
        raise ValueError(
            f"init_from={init_from!r}: its source checkpoint does not record how many tokens it was trained on; "
            "set trainer.max_steps instead of uptrain_fraction"
        )
    world = devices if isinstance(devices, int) else 1
    if not global_batch_size and batch_size == "auto":
        raise ValueError("uptrain_fraction with data.batch_size=auto needs data.global_batch_size (the tokens per step)")
    tokens_per_step = int(global_batch_size or batch_size * world) * int(seq_len)
    return max(1, math.ceil(float(fraction) * source["tokens"] / tokens_per_step))


def source_lr(init_from: str, key: str = "min_lr", factor: float = 1.0) -> float:
    """factor x the source run's lr_ablation.<key> (min_lr: the learning rate its schedule ended at),
    read from the converted checkpoint `init_from`."""
    run = converted_meta(init_from, f"lr_ablation.{key} from the source")["run_config"]
    value = (run.get("lr_ablation") or {}).get(key)
    if value is None:
        raise ValueError(f"init_from={init_from!r}: its source run config records no lr_ablation.{key}; "
                         "set lr_ablation.max_lr and lr_ablation.min_lr explicitly")
    return float(value) * float(factor)


@torch.no_grad()
def validation_loss(model: T6, loader) -> float:
    """Mean next-token cross-entropy of model over a loader of (input [B, T], target [B, T]) batches."""
    model.eval()
    total, count = 0.0, 0
    for x, y in loader:
        logits = model(x)  # [B, T, vocab]
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum").item()
        count += y.numel()
    return total / count
