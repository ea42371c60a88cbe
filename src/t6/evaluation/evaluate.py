"""`python eval.py ckpt_path=...` (`main`): evaluate a saved training checkpoint with the `eval` group, into MLflow."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlflow
import torch
from omegaconf import DictConfig, OmegaConf

from t6.data.tokenizer import Tokenizer, checkpoint_tokenizer
from t6.errors import MissingFile, SettingError
from t6.evaluation.callback import EvalSettings, build_eval_callback
from t6.evaluation.runner import log_results, run_harness
from t6.model.load import build_model, read_checkpoint
from t6.tracking.mlflow import check_tracking_uri


@dataclass
class Evaluation:
    """A checkpoint's evaluation, checked and ready: the model, the tasks, the MLflow run it logs to."""

    path: Path
    model: torch.nn.Module
    callback: object  # t6.evaluation.callback.DownstreamEval: its spec and task manager
    client: mlflow.MlflowClient
    run_id: str
    new_run: bool
    step: int
    tokenizer: Tokenizer  # the checkpoint's (t6.data.tokenizer.checkpoint_tokenizer)


def prepare_evaluation(cfg: DictConfig) -> Evaluation:
    """Everything eval.py checks before it evaluates, the cheap checks first: the checkpoint (missing or damaged:
    named), the store, the tasks and their data, the MLflow run to log into (a new one, the checkpoint's own, or a
    given id)."""
    if OmegaConf.is_missing(cfg, "ckpt_path") or not cfg.ckpt_path:
        raise SettingError(
            "ckpt_path is required: python eval.py ckpt_path=logs/train/runs/<time>/checkpoints/last.ckpt"
        )
    path = Path(cfg.ckpt_path)
    if not path.exists():
        raise MissingFile(f"ckpt_path={str(path)!r} does not exist")
    if not cfg.get("eval"):
        raise SettingError("eval=none: choose an eval group to run (eval=local, eval=paper)")
    ckpt = read_checkpoint(path, "ckpt_path", mmap=True)  # a corrupted file fails here, naming it, in a second
    tokenizer = checkpoint_tokenizer(ckpt)
    check_tracking_uri(cfg.tracking_uri)
    callback = build_eval_callback(EvalSettings.read(cfg.eval))  # tasks, datasets (seconds to minutes); then the model
    run_config, step = ckpt.get("run_config") or {}, int(ckpt.get("global_step", 0))
    run_id = ckpt.get("mlflow_run_id") if cfg.run_id == "train" else cfg.run_id
    if cfg.run_id == "train" and not run_id:
        raise SettingError(f"run_id=train but {path} records no MLflow run; use run_id=null for a new run")

    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(ckpt, "ckpt_path", path, device)  # the file read once, above
    client = mlflow.MlflowClient(tracking_uri=cfg.tracking_uri)
    if run_id is None:
        experiment = cfg.experiment_name or run_config.get("experiment_name", "t6")
        exp = client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
        run = client.create_run(
            exp_id,
            run_name=f"eval-{run_config.get('run_name', path.stem)}",
            tags={
                "checkpoint": str(path.resolve()),
                "source_run_id": str(ckpt.get("mlflow_run_id")),
                "global_step": str(step),
                "tokenizer": tokenizer.id,
            },
        )
        return Evaluation(path, model, callback, client, run.info.run_id, True, step, tokenizer)
    try:
        client.get_run(run_id)
    except mlflow.exceptions.MlflowException as err:
        raise SettingError(f"run_id={run_id!r} is not a run of {cfg.tracking_uri}: {err.message}") from None
    return Evaluation(path, model, callback, client, run_id, False, step, tokenizer)


def evaluate(prepared: Evaluation, eval_cfg: DictConfig) -> tuple[dict[str, float], str]:
    """Run the harness and log the results into the run. Returns (metrics, MLflow run id)."""
    client, run_id, step = prepared.client, prepared.run_id, prepared.step
    run_name = client.get_run(run_id).info.run_name
    results = run_harness(
        prepared.model, prepared.callback.spec, prepared.callback.task_manager, tokenizer=prepared.tokenizer
    )
    metrics = log_results(client, run_id, results, prepared.callback.spec, step, run_name)
    client.log_text(run_id, OmegaConf.to_yaml(eval_cfg, resolve=True), f"eval/step{step:06d}/eval_config.yaml")
    if prepared.new_run:
        client.set_terminated(run_id)
    return metrics, run_id


def evaluate_checkpoint(cfg: DictConfig) -> tuple[dict[str, float], str]:
    """Evaluate cfg.ckpt_path on cfg.eval; log into cfg.run_id (null: a new run, "train": the
    checkpoint's own training run). Returns (metrics, MLflow run id)."""
    return evaluate(prepare_evaluation(cfg), cfg.eval)


def main(cfg: DictConfig) -> float | None:
    """eval.py: evaluate as conf/evaluate.yaml says, print each metric and the MLflow run; returns the average
    accuracy (for Hydra sweepers that optimize a value)."""
    metrics, run_id = evaluate_checkpoint(cfg)
    for name, value in metrics.items():
        if "stderr" not in name:
            print(f"{name:48s} {value:.4f}")
    print(f"MLflow run {run_id}")
    return next((v for k, v in metrics.items() if k.endswith("/avg")), None)
