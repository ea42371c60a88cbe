"""Conversion of a model's attention into any registered mechanism, written as a warm-start checkpoint
(python convert.py; conf/convert.yaml).

The source is anything the one loader reads (t6.model.load): a T6 training or converted checkpoint, a T6
export, a pretrained Llama's Hugging Face directory or GGUF file. The target is the source's shape
with another attention (`target`, `target_kv_heads` for GQA, `options` for the mechanism's own). Every
weight but the attention's is copied; each layer's new attention then starts

1. from a closed form where one exists from the source's attention (t6.uptrain.closed_form: GQA/MQA by
   pooling KV heads, MLA by partial RoPE and a joint low-rank factorization, TPA by fitted factors),
   else from the mechanism's own initialization (`method`);
2. and, for `distill_steps` > 0, is trained to reproduce the source layer's attention output on
   calibration text from the run's data, everything else frozen (t6.uptrain.distill): any mechanism,
   present or future, with no code of its own.

A converted checkpoint holds plain tensors and data only (`torch.load(weights_only=True)`): the T6 state
dict, the target ModelConfig, the tokenizer (the source's), the conversion (target, options, method,
calibration tokens, each layer's attention-output error at the start and after distillation) and its
source (path, MLflow run, training tokens). `python train.py init_from=PATH` uptrains it (with a fresh
optimizer, schedule and MLflow run; the recipe: t6.uptrain.recipe; optionally with the source as
teacher).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from t6.data.batching import sequences_per_step, world_size
from t6.data.tokenizer import checkpoint_tokenizer
from t6.errors import DamagedFile, SettingError
from t6.model import ModelConfig
from t6.model.attention import get_mechanism
from t6.model.attention.gqa import GroupedQueryAttention
from t6.model.facts import meta_model
from t6.model.load import HF_FORMAT, WARM_START_FORMAT, build_model, check_weights, read_checkpoint
from t6.model.t6 import T6
from t6.uptrain.closed_form import POOLING, closed_form
from t6.uptrain.distill import attention_errors, calibration_batches, distill, input_statistics

log = logging.getLogger(__name__)

GQA_FAMILY = ("mha", "gqa", "mqa")
METHODS = ("auto", "closed", *POOLING, "init")  # auto: the closed form where one exists, else init
# Conversion's own defaults for options the closed forms need (those given win): MLA's query path exact
# (q_lora_rank = d_model) and its head widths the source's; TPA's query factored one rank per head.
CLOSED_FORM_DEFAULTS = {
    "mla": lambda cfg, opts: {
        "q_lora_rank": cfg.d_model,
        "nope_dim": cfg.head_dim - opts.get("rope_dim", get_mechanism("mla").default_options()["rope_dim"]),
        "v_dim": cfg.head_dim,
    },
    "tpa": lambda cfg, opts: {"q_rank": cfg.n_head},
}


def target_config(
    source: ModelConfig, target: str, kv_heads: int | None = None, options: dict[str, Any] | None = None
) -> ModelConfig:
    """The converted model's config: the source's shape with `target` attention, kv_heads KV heads (gqa)
    and the mechanism's options (`options`; for the closed forms' sake, some defaults of their own)."""
    try:
        mechanism = get_mechanism(target)
    except KeyError as err:
        raise SettingError(f"target={target!r}: {err.args[0]}") from None
    options = dict(options or {})
    if target == "gqa":
        if not isinstance(kv_heads, int) or isinstance(kv_heads, bool) or kv_heads <= 0:
            raise SettingError(f"target=gqa needs target_kv_heads=G, a positive integer (got {kv_heads!r})")
        if source.n_head % kv_heads:
            divisors = [g for g in range(1, source.n_head + 1) if source.n_head % g == 0]
            raise SettingError(
                f"target_kv_heads={kv_heads} does not divide the source's n_head={source.n_head}; "
                f"choose one of {divisors}"
            )
        options["n_kv_head"] = kv_heads
    elif kv_heads is not None and not (target == "mqa" and kv_heads == 1):
        raise SettingError(
            f"target={target} takes no target_kv_heads (got {kv_heads}); use target=gqa for a number of KV heads"
        )
    if target in CLOSED_FORM_DEFAULTS:
        options = {**CLOSED_FORM_DEFAULTS[target](source, options), **options}
    fields = asdict(source)
    fields.update(attention=mechanism.name, attention_options=options)
    return ModelConfig(**fields)


def kv_head_count(cfg: ModelConfig) -> int | None:
    """KV heads of a grouped-query model (read off the meta-device model); None for other mechanisms."""
    attn = meta_model(cfg).blocks[0].attn
    return attn.n_kv if isinstance(attn, GroupedQueryAttention) else None


def source_tokens(ckpt: dict) -> dict[str, int | None]:
    """Training tokens behind a Lightning checkpoint: samples seen x seq_len. Samples: the data module's
    position, else optimizer steps x the run config's global batch (t6.data.batching); None where the
    checkpoint records neither (or its run's device count was not a number). A converted checkpoint or
    an export: what its own source record says."""
    if "source" in ckpt:
        keep = ("steps", "samples", "seq_len", "tokens")
        return {k: ckpt["source"].get(k) for k in keep}
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


def start_method(method: str, source: T6, target: T6) -> str:
    """What the attention starts from: `method`, with auto resolved (the closed form where one exists from
    the source's attention, else the mechanism's own initialization); a method that cannot apply is an error."""
    if method not in METHODS:
        raise SettingError(f"method={method!r}: choose one of {list(METHODS)}")
    src, dst = source.blocks[0].attn, target.blocks[0].attn
    exists = isinstance(src, GroupedQueryAttention) and closed_form(type(dst)) is not None
    pools = isinstance(dst, GroupedQueryAttention)
    if method == "auto":
        return ("mean" if pools else "closed") if exists else "init"
    if method in POOLING and not (exists and pools):
        raise SettingError(
            f"method={method} pools KV heads: it converts a grouped-query source (mha/gqa/mqa, here "
            f"{source.cfg.attention}) into gqa/mqa/mha (here {target.cfg.attention})"
        )
    if method == "closed" and not exists:
        raise SettingError(
            f"method=closed: there is no closed form from {source.cfg.attention} into {target.cfg.attention}; "
            "use method=init with distill_steps (layer-wise distillation starts any mechanism)"
        )
    return method


def build_target(source: T6, cfg: ModelConfig) -> T6:
    """The target model: every weight but the attention's copied from the source, the attention initialized
    by its mechanism."""
    target = T6(cfg)
    state = {k: v for k, v in source.state_dict().items() if ".attn." not in k}
    missing, unexpected = target.load_state_dict(state, strict=False)
    if unexpected or any(".attn." not in k for k in missing):
        raise RuntimeError(f"the target's non-attention weights differ from the source's: {missing} {unexpected}")
    return target.eval()


def convert_model(
    source: T6,
    cfg: ModelConfig,
    method: str = "auto",
    calibration: list[torch.Tensor] | None = None,
    held_out: list[torch.Tensor] | None = None,
    distill_steps: int = 0,
    distill_lr: float = 1e-3,
) -> tuple[T6, dict[str, Any]]:
    """(the converted model, what the conversion did). calibration: token windows [B, T] from the run's data,
    for the closed forms' statistics and the distillation; held_out: windows the errors are measured on."""
    target = build_target(source, cfg)
    method = start_method(method, source, target)
    batches = calibration_batches(source, calibration) if calibration else []
    held = calibration_batches(source, held_out) if held_out else batches
    if (distill_steps or (method == "closed" and cfg.attention not in GQA_FAMILY)) and not batches:
        raise SettingError("this conversion needs calibration text (its statistics or distillation); give calibration")
    if method != "init":
        form = closed_form(type(target.blocks[0].attn))
        stats = input_statistics(batches) if batches else [None] * cfg.n_layer
        for i, (src, dst) in enumerate(zip(source.blocks, target.blocks)):
            extra = {"method": method} if method in POOLING else {}
            form(src.attn, dst.attn, stats[i], src.attn_norm.weight, **extra)
    record: dict[str, Any] = {"target": cfg.attention, "options": dict(cfg.attention_options), "method": method}
    record["kv_heads"] = kv_head_count(cfg)
    if held:
        record["errors_start"] = attention_errors(target, held)
    record["calibration_tokens"] = sum(b.tokens for b in batches)
    if distill_steps:
        history = distill(target, batches, distill_steps, distill_lr, log_every=max(1, distill_steps // 10))
        record["distill"] = {"steps": distill_steps, "lr": distill_lr, "history": history}
        record["errors_distilled"] = attention_errors(target, held)
    return target, record


def convert_checkpoint(
    ckpt_path: str | Path,
    target: str,
    target_kv_heads: int | None = None,
    method: str = "auto",
    out: str | Path | None = None,
    options: dict[str, Any] | None = None,
    calibration: list[torch.Tensor] | None = None,
    held_out: list[torch.Tensor] | None = None,
    distill_steps: int = 0,
    distill_lr: float = 1e-3,
    ckpt: dict | None = None,
) -> dict:
    """Convert what ckpt_path holds (ckpt: it, already read by t6.model.load.read_checkpoint); returns the
    warm-start checkpoint and writes it to `out` when given."""
    ckpt = read_checkpoint(ckpt_path, "ckpt_path") if ckpt is None else ckpt
    source = build_model(ckpt, "ckpt_path", ckpt_path)
    source_cfg = source.cfg
    cfg = target_config(source_cfg, target, target_kv_heads, options)
    model, conversion = convert_model(source, cfg, method, calibration, held_out, distill_steps, distill_lr)
    new_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    check_weights(new_state, cfg, "converted model")
    origin = ckpt.get("source") or {}
    result = {
        "format": WARM_START_FORMAT,
        "state_dict": new_state,
        "model_config": asdict(cfg),
        "conversion": conversion,
        "source": {
            "ckpt_path": str(Path(ckpt_path).resolve()) if Path(ckpt_path).exists() else str(ckpt_path),
            "mlflow_run_id": ckpt.get("mlflow_run_id") or origin.get("mlflow_run_id"),
            "attention": source_cfg.attention,
            "n_head": source_cfg.n_head,
            "kv_heads": kv_head_count(source_cfg),
            "pretrained": origin.get("pretrained"),
            **source_tokens(ckpt),
        },
        "source_run_config": ckpt.get("run_config") or ckpt.get("source_run_config") or {},
        "tokenizer": checkpoint_tokenizer(ckpt).spec(),
    }
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        torch.save(result, out)
    return result


def load_warm_start(path: str | Path) -> dict:
    """A converted checkpoint, a Hugging Face directory (a T6 export or a pretrained Llama) or a GGUF file for
    `init_from`, checked: the format, and weights that fit its model config."""
    path = Path(path)
    ckpt = read_checkpoint(path, "init_from")
    if ckpt.get("format") not in (WARM_START_FORMAT, HF_FORMAT):
        raise DamagedFile(
            f"init_from={str(path)!r} is not a warm-start checkpoint (write one with `python convert.py`, or give "
            "a Hugging Face directory written by `python export.py`, a pretrained Llama's directory or GGUF file); "
            "to resume a training checkpoint use ckpt_path="
        )
    cfg = ModelConfig(**ckpt["model_config"])
    check_weights(ckpt["state_dict"], cfg, f"init_from={path}")
    return ckpt
