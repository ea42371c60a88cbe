"""Conversion for uptraining (Ainslie et al. 2023, "GQA", §2.1): turn a multi-head checkpoint
into a grouped-query or multi-query one, written as a warm-start checkpoint.

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
optimizer, schedule, step count and MLflow run (the recipe side: t6.uptrain.recipe).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from t6.data.batching import sequences_per_step, world_size
from t6.model import ModelConfig
from t6.model.facts import meta_model
from t6.model.load import HF_FORMAT, WARM_START_FORMAT, check_weights, read_checkpoint

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
                f"target_kv_heads={kv_heads} does not divide the source's n_head={source.n_head}; "
                f"choose one of {divisors}"
            )
        options = {"n_kv_head": kv_heads}
    fields = asdict(source)
    fields.update(attention=target, attention_options=options)
    return ModelConfig(**fields)


def kv_head_count(cfg: ModelConfig) -> int:
    """KV heads of the model cfg builds (its attention decides; read off the meta-device model)."""
    return meta_model(cfg).blocks[0].attn.n_kv


def convert_state_dict(
    state: dict[str, torch.Tensor], source: ModelConfig, target: ModelConfig, method: str = "mean"
) -> dict[str, torch.Tensor]:
    """Map a T6 state dict from the source (MHA) config to the target (GQA/MQA) config."""
    groups = kv_head_count(target)
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
    """Training tokens behind a Lightning checkpoint: samples seen x seq_len. Samples: the data module's
    position, else optimizer steps x the run config's global batch (t6.data.batching); None where the
    checkpoint records neither (or its run's device count was not a number)."""
    run = ckpt.get("run_config") or {}
    data, trainer = run.get("data", {}), run.get("trainer", {})
    seq_len = int(data.get("seq_len") or ckpt["hyper_parameters"]["model_config"]["block_size"])
    samples = (ckpt.get("TokenDataModule") or {}).get("samples_seen")
    world = world_size(trainer.get("devices", 1), trainer.get("num_nodes", 1))
    global_batch = data.get("global_batch_size")
    if samples is None and "global_step" in ckpt and (global_batch or (data.get("batch_size") and world)):
        samples = int(ckpt["global_step"]) * sequences_per_step(data.get("batch_size"), global_batch, world)
    return {
        "steps": ckpt.get("global_step"),
        "samples": samples,
        "seq_len": seq_len,
        "tokens": None if samples is None else int(samples) * seq_len,
    }


def convert_checkpoint(
    ckpt_path: str | Path,
    target: str,
    target_kv_heads: int | None = None,
    method: str = "mean",
    out: str | Path | None = None,
) -> dict:
    """Convert an MHA training checkpoint; returns the warm-start checkpoint and writes it to `out` when given."""
    ckpt = load_training_checkpoint(ckpt_path)
    source_cfg = ModelConfig(**ckpt["hyper_parameters"]["model_config"])
    prefix = "model."
    state = {k[len(prefix) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    check_weights(state, source_cfg, f"source checkpoint {ckpt_path}")
    cfg = target_config(source_cfg, target, target_kv_heads)
    new_state = convert_state_dict(state, source_cfg, cfg, method)
    check_weights(new_state, cfg, "converted model")
    result = {
        "format": WARM_START_FORMAT,
        "state_dict": new_state,
        "model_config": asdict(cfg),
        "conversion": {"target": target, "kv_heads": kv_head_count(cfg), "method": method},
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
    """A converted checkpoint or a Hugging Face directory for `init_from`, checked: the format, and weights
    that fit its model config."""
    path = Path(path)
    ckpt = read_checkpoint(path, "init_from")
    if ckpt.get("format") not in (WARM_START_FORMAT, HF_FORMAT):
        raise ValueError(
            f"init_from={str(path)!r} is not a warm-start checkpoint (write one with `python convert.py`, or give "
            "a Hugging Face directory written by `python export.py`); to resume a training checkpoint use ckpt_path="
        )
    cfg = ModelConfig(**ckpt["model_config"])
    check_weights(ckpt["state_dict"], cfg, f"init_from={path}")
    return ckpt
