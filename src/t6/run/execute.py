"""`execute(plan)`: build the plan's components and fit. Every decision was made by `t6.run.plan.plan_run`, every
argument of every component too; this builds, in order:

0. the run directory, held by this run alone (t6.run.process.run_directory), what a killed run left half written
   in it removed;
1. the data (the embedded corpus is tokenized on first use), the MLflow store, the LightningModule (with a warm
   start's weights);
2. the callbacks (the plan's, and the downstream evaluation, which writes its tasks), the loggers, the plugins and
   the Trainer;
3. the announcement and the run's parameters in MLflow (its writes go through an outbox, t6.tracking.outbox);
4. fit; a stop signal ends it at a step every rank agreed on, with last.ckpt saved there (t6.training.stop), and the
   MLflow run ends as KILLED before `RunStopped` leaves; a failure leaves it FAILED with its last step and error;
5. the model upload and the greedy samples.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import OmegaConf

from t6.evaluation.callback import build_eval_callback
from t6.hardware.probes import env_rank
from t6.hydra_config import flatten
from t6.model.facts import model_facts
from t6.model.load import load_model
from t6.run.plan import RunPlan
from t6.run.process import destroy_process_group, run_directory, run_settings
from t6.run.samples import log_samples
from t6.tracking.logger import OutboxMLFlowLogger
from t6.tracking.mlflow import open_tracking_store, save_and_upload_model, tag_training_experiment
from t6.training.checkpoint_io import remove_stale_writes
from t6.training.module import T6LitModule
from t6.training.stop import RunStopped, StopProtocol

log = logging.getLogger(__name__)


def execute(plan: RunPlan) -> tuple[dict[str, float], dict[str, Any]]:
    """Fit as planned, holding the run directory. Returns (final metrics, the objects built: model, datamodule,
    trainer, mlflow, plan, ...)."""
    with run_directory(plan.run_dir, env_rank()), run_settings(plan):
        if env_rank() == 0 and Path(plan.checkpoint_dir).is_dir():
            for name in remove_stale_writes(plan.checkpoint_dir):
                log.warning("removed %s, a write a killed run left in %s", name, plan.checkpoint_dir)
        return fit(plan)


def fit(plan: RunPlan) -> tuple[dict[str, float], dict[str, Any]]:
    datamodule: L.LightningDataModule = instantiate(
        plan.cfg.data, batch_size=plan.batch.micro_batch, seq_len=plan.batch.seq_len, tokenizer=plan.tokenizer
    )
    datamodule.prepare_data()
    datamodule.setup("fit")
    if plan.tracking is not None:
        open_tracking_store(plan.tracking.uri)
    L.seed_everything(plan.training.seed, workers=True)
    model = build_module(plan)
    eval_callback = build_eval_callback(plan.evaluation, plan.tokenizer)
    trainer = build_trainer(plan, eval_callback)
    announce(plan)

    mlflow = next((lg for lg in trainer.loggers if isinstance(lg, OutboxMLFlowLogger)), None)
    if mlflow is not None and plan.tracking.run_id is None:
        if trainer.is_global_zero:  # MLflow's UI: the model-training view
            tag_training_experiment(mlflow.experiment, mlflow.experiment_id)
        log_run_config(mlflow, plan)
    elif mlflow is not None and trainer.is_global_zero:
        mlflow.experiment.update_run(mlflow.run_id, status="RUNNING")  # it was KILLED or FAILED when interrupted
        redone = redone_steps(plan)
        if redone:  # logged before, redone from the checkpoint: their points are the earlier ones
            mlflow.experiment.set_tag(mlflow.run_id, "redone_steps", redone)

    uploaded, samples, sent = None, [], True
    try:
        ckpt_path = plan.resume.ckpt_path if plan.resume else None
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    except RunStopped:
        if mlflow is not None and trainer.is_global_zero:
            mlflow.experiment.set_tag(mlflow.run_id, "last_step", str(trainer.global_step))
            mlflow.experiment.set_terminated(mlflow.run_id, "KILLED")
        raise
    except Exception as err:
        if trainer.world_size > 1:  # a peer that died, a disk that filled: what this rank saw, and what is left
            log.error(failure_note(trainer, plan, err))
        if mlflow is not None and trainer.is_global_zero:  # FAILED (the logger's finalize), with where and why
            mlflow.experiment.set_tag(mlflow.run_id, "last_step", str(trainer.global_step))
            mlflow.experiment.set_tag(mlflow.run_id, "error", f"{type(err).__name__}: {err}"[:5000])
        raise
    else:
        if mlflow is not None and trainer.is_global_zero:
            mlflow.experiment.set_tag(mlflow.run_id, "last_step", str(trainer.global_step))  # for report.py
        if plan.tracking is not None:
            uploaded = save_and_upload_model(trainer, mlflow, plan.checkpoint_dir, plan.tracking.upload)
        samples = log_samples(plan.samples, trainer, model.model, mlflow, plan.tokenizer)
    finally:
        stop = StopProtocol.of(trainer)
        if stop is not None:
            stop.signals.restore()  # kept through a failure's note and tags (StopProtocol.on_exception)
        destroy_process_group()  # a sweep's next job in this process starts its own group
        if mlflow is not None:
            sent = mlflow.close()  # what waits for the store is sent now (up to logger.mlflow.flush_timeout_s)

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if eval_callback is not None and eval_callback.history:
        metrics.update(eval_callback.history[-1][1])  # the last downstream evaluation (rank 0)
    objects = {
        "plan": plan,
        "model": model,
        "datamodule": datamodule,
        "trainer": trainer,
        "mlflow": mlflow,
        "uploaded": uploaded,
        "sent": sent,  # whether the store has every write of the run (else they wait in the outbox)
        "samples": samples,
    }
    return metrics, objects


def redone_steps(plan: RunPlan) -> str | None:
    """The optimizer steps a resume redoes ("5-6"): after its checkpoint, up to the last one the run logged."""
    logged = plan.tracking.logged.get("train/loss") if plan.tracking is not None and plan.resume else None
    if logged is None or logged + 1 <= plan.resume.step:  # train/loss of step s is logged at s - 1
        return None
    return f"{plan.resume.step + 1}-{logged + 1}"


def build_module(plan: RunPlan) -> T6LitModule:
    """The LightningModule of the plan's model, optimizer, schedule and loss, with a warm start's weights."""
    cfg = plan.cfg
    model = T6LitModule(
        model_config=asdict(plan.model),
        optimizer=instantiate(cfg.optimizer, **plan.training.optimizer_args),
        scheduler=schedule(plan),
        compile=plan.hardware.compile,
        run_config=OmegaConf.to_container(plan.logged_cfg, resolve=True),
        nonfinite_loss=plan.training.nonfinite_loss,
        loss_chunk_tokens=plan.training.loss_chunk_tokens,
        loss_impl=plan.training.loss_impl,
        gradient_checkpointing=plan.training.gradient_checkpointing,
        tokenizer=plan.tokenizer.spec() if plan.tokenizer is not None else None,
        teacher=load_model(plan.training.teacher, what="teacher") if plan.training.teacher else None,
        teacher_kl_weight=plan.training.teacher_kl_weight,
    )
    if plan.warm_start is not None:
        from t6.uptrain.convert import load_warm_start

        model.model.load_state_dict(load_warm_start(plan.warm_start.path)["state_dict"])  # a resume overrides these
    return model


def schedule(plan: RunPlan):
    """The learning-rate schedule the plan decided (its steps follow a warm start's data.seq_len), or None."""
    if plan.schedule is None:
        return None
    s = plan.schedule
    return s.scheduler.build(warmup_steps=s.warmup, total_steps=s.total, max_lr=s.max_lr, min_lr=s.min_lr)


def failure_note(trainer: L.Trainer, plan: RunPlan, err: BaseException) -> str:
    """The line a rank of a multi-process run leaves when training fails: the error, the step, and the last
    complete checkpoint to resume from (a rank killed outright, or a write that failed, leaves the others with
    a collective whose peer is gone: this says so once instead of in a library's words only)."""
    last = Path(plan.checkpoint_dir) / "last.ckpt"
    kept = (
        f"the last complete checkpoint is {last}: re-run the same command to resume from it"
        if last.is_file()
        else "no checkpoint was saved yet"
    )
    first = str(err).splitlines()[0][:300] if str(err) else ""
    return (
        f"training stopped on rank {trainer.global_rank} of {trainer.world_size} at step {trainer.global_step}: "
        f"{type(err).__name__}: {first} (when another rank died or failed first, its own error is the cause); {kept}"
    )


def build_trainer(plan: RunPlan, eval_callback: L.Callback | None) -> L.Trainer:
    """The plan's Trainer: its device, processes, precision and strategy, its plugins, the plan's callbacks (the
    downstream evaluation before the stop protocol, which is last) and loggers."""
    callbacks = [c.build() for c in plan.callbacks]
    if eval_callback is not None:
        callbacks.insert(len(callbacks) - 1, eval_callback)
    strategy = plan.parallel.lightning_strategy
    return plan.trainer.build(
        strategy=strategy if isinstance(strategy, str) else strategy.build(),
        plugins=[p.build() for p in plan.plugins],
        callbacks=callbacks,
        logger=[lg.build() for lg in plan.loggers] or False,
    )


@rank_zero_only
def announce(plan: RunPlan) -> None:
    """The opening lines: what the plan decided and why, and its warnings."""
    log.info("run plan\n%s", plan.describe())
    for warning in plan.warnings:
        log.warning(warning)


def log_run_config(logger: OutboxMLFlowLogger, plan: RunPlan) -> None:
    """Once per run: the flattened, resolved config (with a warm start's model shape) and the plan's decisions as
    params, the model's size and KV cache per token (`model/...`, measured on the built model, cache in bf16) for
    the report, the YAML as an artifact, the checkpoint dir as a tag."""
    config = plan.logged_cfg
    resolved = OmegaConf.to_container(config, resolve=True)
    facts = model_facts(plan.model)  # KV cache counted in bf16
    logger.log_hyperparams({**flatten(resolved), **plan.params(), **{f"model/{k}": v for k, v in facts.items()}})
    if rank_zero_only.rank == 0:
        logger.experiment.log_text(logger.run_id, OmegaConf.to_yaml(config, resolve=True), "config.yaml")
        logger.experiment.set_tag(logger.run_id, "checkpoints", plan.checkpoint_dir)
