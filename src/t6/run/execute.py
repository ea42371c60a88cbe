"""`execute(plan)`: build the Lightning objects a `RunPlan` describes and fit. Every decision was made by
`t6.run.plan.plan_run`; this only carries them out, in order:

1. the data (the embedded corpus is tokenized on first use), the evaluation's local tasks, the MLflow store;
2. the LightningModule (with a warm start's weights), loggers, callbacks and the Trainer;
3. the announcement, the run's parameters in MLflow (its writes go through an outbox, t6.tracking.outbox),
   the system-metrics monitor of every node (a callback);
4. fit; a stop signal (SIGTERM, SIGINT, SIGUSR1/2 to any rank) is agreed on by every rank at an optimizer
   step's end (t6.training.preemption), last.ckpt is saved there (t6.training.callbacks.PreemptionCheckpoint)
   and the MLflow run ends as KILLED before the SIGTERMException leaves, carrying the signal as `signum`;
5. the model upload and the greedy samples.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from t6.config import flatten
from t6.evaluation.callback import build_eval_callback
from t6.model.facts import model_facts
from t6.model.load import load_model
from t6.run.launch import destroy_process_group
from t6.run.plan import RunPlan
from t6.run.samples import log_samples
from t6.tracking.logger import OutboxMLFlowLogger
from t6.tracking.mlflow import open_tracking_store, save_and_upload_model, tag_training_experiment
from t6.tracking.system_metrics import SystemMetrics
from t6.training import preemption
from t6.training.callbacks import SameMicroBatch
from t6.training.module import T6LitModule
from t6.training.preemption import stop_signals

log = logging.getLogger(__name__)


def execute(plan: RunPlan) -> tuple[dict[str, float], dict[str, Any]]:
    """Fit as planned. Returns (final metrics, the objects built: model, datamodule, trainer, mlflow, plan, ...)."""
    with stop_signals:  # from here on a stop signal is a request the ranks agree on (t6.training.preemption)
        return run_plan(plan)


def run_plan(plan: RunPlan) -> tuple[dict[str, float], dict[str, Any]]:
    cfg = plan.cfg
    datamodule: L.LightningDataModule = instantiate(cfg.data)
    datamodule.prepare_data()
    datamodule.setup("fit")
    eval_callback = build_eval_callback(cfg.get("eval"), plan.tokenizer)
    if plan.tracking is not None:
        open_tracking_store(plan.tracking.uri)
    L.seed_everything(cfg.seed, workers=True)
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")  # TF32 for the fp32 matmuls left outside autocast (A100 and later)

    model = T6LitModule(
        model_config=asdict(plan.model),
        optimizer=instantiate(cfg.optimizer),
        scheduler=instantiate(cfg.lr_ablation.scheduler) if cfg.lr_ablation.get("scheduler") else None,
        compile=plan.hardware.compile,
        run_config=OmegaConf.to_container(cfg, resolve=True),
        nonfinite_loss=cfg.get("nonfinite_loss", "stop"),
        loss_chunk_tokens=cfg.get("loss_chunk_tokens"),
        loss_impl=cfg.get("loss_impl", "auto"),
        tokenizer=plan.tokenizer.spec() if plan.tokenizer is not None else None,
        teacher=load_model(cfg.teacher, what="teacher") if cfg.get("teacher") else None,
        teacher_kl_weight=cfg.get("teacher_kl_weight", 0.5),
    )
    if plan.warm_start is not None:
        from t6.uptrain.convert import load_warm_start

        model.model.load_state_dict(load_warm_start(plan.warm_start.path)["state_dict"])  # a resume overrides these
    trainer = build_trainer(plan, eval_callback)
    preemption.install(trainer)
    if trainer.world_size != plan.parallel.world_size:
        raise RuntimeError(
            f"Lightning started {trainer.world_size} processes where the plan counted {plan.parallel.world_size} "
            f"(trainer.devices={cfg.trainer.get('devices')}, trainer.num_nodes={cfg.trainer.get('num_nodes', 1)}); "
            "give trainer.devices as a number"
        )
    announce(plan)

    mlflow = next((lg for lg in trainer.loggers if isinstance(lg, OutboxMLFlowLogger)), None)
    checkpoint_dir = trainer.checkpoint_callback.dirpath if trainer.checkpoint_callback else ""
    if mlflow is not None and plan.tracking.run_id is None:
        if trainer.is_global_zero:  # MLflow's UI: the model-training view
            tag_training_experiment(mlflow.experiment, mlflow.experiment_id)
        log_run_config(mlflow, plan, str(checkpoint_dir))
    elif mlflow is not None and trainer.is_global_zero:
        mlflow.experiment.update_run(mlflow.run_id, status="RUNNING")  # it was KILLED or FAILED when interrupted

    uploaded = None
    try:
        ckpt_path = plan.resume.ckpt_path if plan.resume else None
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    except SIGTERMException as stop:
        if mlflow is not None and trainer.is_global_zero and mlflow.run_id:
            mlflow.experiment.set_tag(mlflow.run_id, "last_step", str(trainer.global_step))
            mlflow.experiment.set_terminated(mlflow.run_id, "KILLED")
        stop.signum = stop_signals.agreed or signal.SIGTERM
        stop.cluster_environment = getattr(trainer.strategy, "cluster_environment", None)  # for hand_over
        raise
    except Exception as err:
        if trainer.world_size > 1:  # a peer that died, a disk that filled: what this rank saw, and what is left
            log.error(failure_note(trainer, err))
        raise
    else:
        if mlflow is not None and trainer.is_global_zero:
            mlflow.experiment.set_tag(mlflow.run_id, "last_step", str(trainer.global_step))  # for report.py
        uploaded = save_and_upload_model(trainer, mlflow, checkpoint_dir)  # logger.mlflow.log_model
        samples = log_samples(cfg, trainer, model.model, mlflow)
    finally:
        destroy_process_group()  # a sweep's next job in this process starts its own group
        if mlflow is not None:
            mlflow.close()  # what waits for the store is sent now (up to logger.mlflow.flush_timeout_s)

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if eval_callback is not None and eval_callback.history:
        metrics.update(eval_callback.history[-1][1])  # the last downstream evaluation (rank 0)
    objects = {
        "cfg": cfg,
        "plan": plan,
        "model": model,
        "datamodule": datamodule,
        "trainer": trainer,
        "mlflow": mlflow,
        "uploaded": uploaded,
        "samples": samples,
    }
    return metrics, objects


def failure_note(trainer: L.Trainer, err: BaseException) -> str:
    """The line a rank of a multi-process run leaves when training fails: the error, the step, and the last
    complete checkpoint to resume from (a rank killed outright, or a write that failed, leaves the others with
    a collective whose peer is gone: this says so once instead of in a library's words only)."""
    ckpt = trainer.checkpoint_callback
    last = Path(ckpt.dirpath) / "last.ckpt" if ckpt is not None and ckpt.dirpath else None
    kept = (
        f"the last complete checkpoint is {last}: re-run the same command to resume from it"
        if last is not None and last.is_file()
        else "no checkpoint was saved yet"
    )
    first = str(err).splitlines()[0][:300] if str(err) else ""
    return (
        f"training stopped on rank {trainer.global_rank} of {trainer.world_size} at step {trainer.global_step}: "
        f"{type(err).__name__}: {first} (when another rank died or failed first, its own error is the cause); {kept}"
    )


def instantiate_dict(group: DictConfig | None) -> list[Any]:
    """Instantiate every `_target_` entry of a dict-of-configs group (callbacks, loggers)."""
    if not group:
        return []
    return [instantiate(conf) for conf in group.values() if isinstance(conf, DictConfig) and "_target_" in conf]


def build_trainer(plan: RunPlan, eval_callback: L.Callback | None) -> L.Trainer:
    """The Trainer of the plan: its loggers (an MLflow run is created on first use) and callbacks, the
    accumulation that keeps data.global_batch_size, validation counted in optimizer steps."""
    cfg = plan.cfg
    callbacks = instantiate_dict(cfg.get("callbacks")) + ([eval_callback] if eval_callback else [])
    if plan.tracking is not None and plan.tracking.system_metrics_s:
        callbacks.append(SystemMetrics(plan.tracking.system_metrics_s))  # one monitor per node
    if plan.batch.memory is not None and plan.batch.memory.auto and plan.parallel.world_size > 1:
        callbacks.append(SameMicroBatch(plan.batch.micro_batch, plan.batch.memory.available))  # ranks compare plans
    accumulate = plan.batch.accumulation
    every = cfg.trainer.get("val_check_interval")
    return instantiate(
        cfg.trainer,
        callbacks=callbacks,
        logger=instantiate_dict(cfg.get("logger")) or False,
        accumulate_grad_batches=accumulate,
        # Lightning counts micro-batches; the config counts optimizer steps
        val_check_interval=every * accumulate if isinstance(every, int) else every,
    )


@rank_zero_only
def announce(plan: RunPlan) -> None:
    """The opening lines: what the plan decided and why, and its warnings."""
    log.info("run plan\n%s", plan.describe())
    for warning in plan.warnings:
        log.warning(warning)


def log_run_config(logger: OutboxMLFlowLogger, plan: RunPlan, checkpoint_dir: str) -> None:
    """Once per run: the flattened, resolved config and the plan's decisions as params, the model's size and
    KV cache per token (`model/...`, measured on the built model, cache in bf16) for the report, the YAML as
    an artifact, the checkpoint dir as a tag."""
    resolved = OmegaConf.to_container(plan.cfg, resolve=True)
    facts = model_facts(plan.model)  # KV cache counted in bf16
    logger.log_hyperparams({**flatten(resolved), **plan.params(), **{f"model/{k}": v for k, v in facts.items()}})
    if rank_zero_only.rank == 0:
        logger.experiment.log_text(logger.run_id, OmegaConf.to_yaml(plan.cfg, resolve=True), "config.yaml")
        logger.experiment.set_tag(logger.run_id, "checkpoints", checkpoint_dir)
