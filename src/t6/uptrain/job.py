"""`python convert.py` (conf/convert.yaml, `main`): read the source once, take calibration text from the run's
data in the source's tokenizer, convert (t6.uptrain.convert), write the checkpoint, and record the
conversion as an MLflow run of its own beside the source's, so `report.py --experiment NAME` shows them
side by side (attention, validation loss, KV cache per token)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from t6.data.datamodule import TrainStream
from t6.data.tokenizer import checkpoint_tokenizer
from t6.errors import SettingError
from t6.model.facts import model_facts
from t6.model.load import build_model, model_state, read_checkpoint
from t6.model.loss import mean_loss
from t6.uptrain.convert import convert_checkpoint

log = logging.getLogger(__name__)


def calibration_windows(data_cfg: DictConfig, tokenizer, batches: int, held_out: int):
    """(calibration batches [B, T] from the training stream, held-out batches from the validation split, the
    validation loader) of the run's data in the source's tokenizer."""
    dm = instantiate(data_cfg, tokenizer=tokenizer)
    dm.prepare_data()
    dm.setup("fit")
    stream = iter(TrainStream(dm.train_windows, dm.seed, True, 0, 0, 1, dm.batch_size))
    train = [torch.stack([next(stream)[0] for _ in range(dm.batch_size)]) for _ in range(batches)]
    val = [
        torch.stack([dm.val_set.windows.get(b * dm.batch_size + i)[0] for i in range(dm.batch_size)])
        for b in range(held_out)
    ]
    return train, val, dm.val_dataloader()


def run(cfg: DictConfig) -> list[str]:
    """Convert as conf/convert.yaml says; returns the lines to print."""
    for name in ("ckpt_path", "out"):
        if OmegaConf.is_missing(cfg, name) or not cfg.get(name):
            raise SettingError(f"{name} is required: python convert.py ckpt_path=SOURCE target=mla out=ckpt/mla.ckpt")
    ckpt = read_checkpoint(cfg.ckpt_path, "ckpt_path")
    tokenizer = checkpoint_tokenizer(ckpt)
    source, _ = model_state(ckpt, "ckpt_path", cfg.ckpt_path)
    if int(cfg.data.seq_len) > source.block_size:
        raise SettingError(
            f"data.seq_len={cfg.data.seq_len}: the calibration windows are longer than the source's context "
            f"(ckpt_path={cfg.ckpt_path} has size.block_size={source.block_size}); "
            f"set data.seq_len<={source.block_size}"
        )
    needs_text = cfg.distill_steps > 0 or cfg.target not in ("gqa", "mqa", "mha") or cfg.get("evaluate", True)
    calibration = held = loader = None
    if needs_text:
        calibration, held, loader = calibration_windows(
            cfg.data, tokenizer, cfg.calibration_batches, cfg.held_out_batches
        )
    options = OmegaConf.to_container(cfg.options, resolve=True) if cfg.get("options") else {}
    torch.manual_seed(cfg.seed)
    result = convert_checkpoint(
        cfg.ckpt_path,
        cfg.target,
        cfg.target_kv_heads,
        cfg.method,
        cfg.out,
        options,
        calibration,
        held,
        cfg.distill_steps,
        cfg.distill_lr,
        ckpt=ckpt,
    )
    conv, src = result["conversion"], result["source"]
    lines = [
        f"wrote {cfg.out}: {src['attention']} -> {conv['target']} {conv['options']} (start: {conv['method']}"
        + (f", distilled {cfg.distill_steps} steps" if cfg.distill_steps else "")
        + f"; calibration {conv['calibration_tokens']:,} tokens, tokenizer {tokenizer.name})"
    ]
    for key, label in (("errors_start", "at the start"), ("errors_distilled", "after distillation")):
        if key in conv:
            errors = conv[key]
            lines.append(
                f"attention-output error {label}: mean {sum(errors) / len(errors):.4f} "
                f"(layers {', '.join(f'{e:.3f}' for e in errors)})"
            )
    if loader is not None:
        losses = {"source": mean_loss(build_model(ckpt, "ckpt_path", cfg.ckpt_path), loader)}
        losses["converted"] = mean_loss(build_model(result, "out", cfg.out), loader)
        conv["val_loss"], conv["source_val_loss"] = losses["converted"], losses["source"]
        torch.save(result, cfg.out)
        lines.append(f"validation loss: source {losses['source']:.4f}, converted {losses['converted']:.4f}")
    if cfg.get("tracking_uri"):
        run_id = log_conversion(cfg, ckpt, result)
        lines.append(f"MLflow run {run_id} (experiment {cfg.experiment_name!r})")
    lines.append(
        f"uptrain with: python train.py experiment=uptrain init_from={cfg.out} "
        + (
            "uptrain_fraction=0.05"
            if src.get("tokens")
            else "trainer.max_steps=N lr_ablation.max_lr=LR lr_ablation.min_lr=LR"
        )
    )
    return lines


def log_conversion(cfg: DictConfig, ckpt: dict, result: dict) -> str:
    """The conversion as an MLflow run (params: attention.name and its options, the source, the method;
    metrics: validation losses, each layer's attention-output error; the model's facts), and, for a source
    with no run of its own (a pretrained model), a run for the source beside it. Returns the conversion's run id."""
    from mlflow import MlflowClient

    from t6.hydra_config import flatten
    from t6.model import ModelConfig

    client = MlflowClient(tracking_uri=cfg.tracking_uri)
    experiment = client.get_experiment_by_name(cfg.experiment_name)
    exp_id = experiment.experiment_id if experiment else client.create_experiment(cfg.experiment_name)
    conv, src = result["conversion"], result["source"]
    source_cfg, _ = model_state(ckpt, "ckpt_path", cfg.ckpt_path)
    source_run = src.get("mlflow_run_id")
    if not source_run:
        source_run = new_run(
            client,
            exp_id,
            f"source-{Path(str(cfg.ckpt_path)).stem}",
            {
                "attention.name": source_cfg.attention,
                "source": src["ckpt_path"],
                "tokenizer/id": result["tokenizer"]["id"],
            },
            {"val/loss": conv.get("source_val_loss")},
            source_cfg,
            {},
        )
    target_cfg = ModelConfig(**result["model_config"])
    params: dict[str, Any] = {
        "attention.name": conv["target"],
        **flatten({"attention": {"options": conv["options"]}}),
        "convert/method": conv["method"],
        "convert/distill_steps": cfg.distill_steps,
        "convert/calibration_tokens": conv["calibration_tokens"],
        "source": src["ckpt_path"],
        "source.attention": src["attention"],
        "tokenizer/id": result["tokenizer"]["id"],
        "out": str(Path(cfg.out).resolve()),
    }
    metrics = {"val/loss": conv.get("val_loss"), "source/val_loss": conv.get("source_val_loss")}
    steps = {}
    for key in ("errors_start", "errors_distilled"):
        if key in conv:
            metrics[f"convert/{key}_mean"] = sum(conv[key]) / len(conv[key])
            steps[f"convert/{key}"] = conv[key]
    return new_run(
        client, exp_id, f"convert-{conv['target']}", params, metrics, target_cfg, steps, {"source_run_id": source_run}
    )


def new_run(client, exp_id, name, params, metrics, model_cfg, per_step, tags=None) -> str:
    from mlflow.entities import Metric, Param
    from mlflow.utils.time import get_current_time_millis

    run = client.create_run(exp_id, run_name=name, tags=dict(tags or {}))
    now = get_current_time_millis()
    facts = {f"model/{k}": v for k, v in model_facts(model_cfg).items()}
    values = [Metric(k, float(v), now, 0) for k, v in metrics.items() if v is not None]
    values += [Metric(k, float(v), now, i) for k, series in per_step.items() for i, v in enumerate(series)]
    client.log_batch(
        run.info.run_id,
        metrics=values,
        params=[Param(k, str(v)[:6000]) for k, v in {**params, **facts}.items()],
        synchronous=True,
    )
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def main(cfg: DictConfig) -> None:
    """convert.py: convert as conf/convert.yaml says and print what was done."""
    for line in run(cfg):
        print(line)
