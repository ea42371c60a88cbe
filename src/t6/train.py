"""`train(cfg)`: everything `python train.py` does, as a pure function tests call directly.

Order matters for failing early: the model config, data shards and tracking store are all
checked before the Trainer starts, so a bad option costs seconds, not a run.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf, open_dict

from t6.callbacks import PreemptionCheckpoint
from t6.checkpoint import resolve_ckpt_path
from t6.config import flatten, model_config
from t6.distributed import destroy_process_group
from t6.evaluation.callback import build_eval_callback
from t6.module import T6LitModule
from t6.quiet import quiet_libraries
from t6.summary import summarize
from t6.sweep import attach_to_sweep, sweep_job_info
from t6.tracking import check_tracking_uri, mlflow_config, save_and_upload_model
from t6.uptrain import WARM_START_FORMAT, adopt_model_config, load_warm_start

log = logging.getLogger(__name__)


def instantiate_dict(group: DictConfig | None) -> list[Any]:
    """Instantiate every `_target_` entry of a dict-of-configs group (callbacks, loggers)."""
    if not group:
        return []
    return [instantiate(conf) for conf in group.values() if isinstance(conf, DictConfig) and "_target_" in conf]


def read_checkpoint_meta(ckpt_path: str) -> dict:
    """The plain-data entries of a checkpoint (no tensors loaded into memory, no pickled code run)."""
    path = Path(ckpt_path)
    if not path.is_file():
        raise FileNotFoundError(f"ckpt_path={ckpt_path!r} does not exist")
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if ckpt.get("format") == WARM_START_FORMAT:
        raise ValueError(f"ckpt_path={ckpt_path!r} is a converted (warm-start) checkpoint: start from it with init_from=")
    return {k: ckpt[k] for k in ("mlflow_run_id", "run_config", "global_step") if k in ckpt}


@rank_zero_only
def print_config_tree(cfg: DictConfig) -> None:
    import rich
    import rich.syntax
    import rich.tree

    tree = rich.tree.Tree("CONFIG", guide_style="dim")
    for key, value in cfg.items():
        branch = tree.add(str(key))
        text = OmegaConf.to_yaml(value, resolve=True) if isinstance(value, DictConfig) else str(value)
        branch.add(rich.syntax.Syntax(text, "yaml"))
    rich.print(tree)


def check_learning_rate(cfg: DictConfig) -> None:
    """One source for the peak learning rate: lr_ablation.max_lr. The schedule multiplies the optimizer's
    lr by lr(step) / max_lr, so an optimizer.lr that differs would silently scale the whole schedule."""
    lr, max_lr = cfg.optimizer.get("lr"), cfg.lr_ablation.get("max_lr")
    if cfg.lr_ablation.get("scheduler") and lr is not None and max_lr is not None and float(lr) != float(max_lr):
        raise ValueError(
            f"optimizer.lr={lr} differs from lr_ablation.max_lr={max_lr}, the schedule's peak; set the peak with "
            f"lr_ablation.max_lr={lr} (and lr_ablation.min_lr), and leave optimizer.lr to follow it"
        )


def check_no_dataset(cfg: DictConfig) -> None:
    """`dataset=` is listed by --help (a group of conf/) but belongs to prepare.py."""
    if cfg.get("dataset") is not None:
        raise ValueError("dataset= chooses what prepare.py tokenizes; prepare it (python prepare.py dataset=local "
                         "dataset.data_files=FILE.jsonl), then train on the shards with data=local (or data=fineweb_edu)")


def first_job() -> bool:
    """A single run, or a sweep's first job (the config tree is printed once per sweep; Hydra prints
    each later job's overrides)."""
    from hydra.core.hydra_config import HydraConfig

    from t6.distributed import in_multirun

    return not in_multirun() or int(HydraConfig.get().job.num) == 0


HYDRA_ONLY = {".hydra", "train.log", "eval.log"}  # what Hydra writes into a run directory by itself


def discard_unused_run_dir(run_dir: str | Path) -> bool:
    """Remove a run directory holding nothing but what Hydra wrote at start (its .hydra/ and the log):
    the trace of a run that failed on its config before doing anything. Returns whether it did."""
    import shutil

    path = Path(run_dir)
    if not path.is_dir() or not {p.name for p in path.iterdir()} <= HYDRA_ONLY:
        return False
    shutil.rmtree(path)
    return True


MODEL_FACTS = ("params", "params_non_embedding", "kv_cache_elements_per_token_per_layer", "kv_cache_bytes_per_token")


def log_run_config(logger: MLFlowLogger, cfg: DictConfig, checkpoint_dir: str, mcfg) -> None:
    """Once per run: the flattened, resolved config as params, the model's size and KV cache per
    token (`model/...`, measured on the built model, cache in bf16) for the report, the YAML as an
    artifact, the checkpoint dir as a tag."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    facts = summarize(mcfg, cfg.attention.name, cfg.size.name, flops=False)
    logger.log_hyperparams({**flatten(resolved), **{f"model/{k}": facts[k] for k in MODEL_FACTS}})
    if rank_zero_only.rank == 0:
        logger.experiment.log_text(logger.run_id, OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
        logger.experiment.set_tag(logger.run_id, "checkpoints", checkpoint_dir)


def train(cfg: DictConfig) -> tuple[dict[str, float], dict[str, Any]]:
    """Train a T6 as configured. Returns (final metrics, the objects built: model, datamodule, trainer, ...)."""
    quiet_libraries()  # drops a few library messages that say nothing about this run (t6.quiet)
    # 1. Validate everything that can be validated without training.
    # A warm start (init_from) takes the model shape and weights from a converted checkpoint,
    # with a fresh optimizer, schedule, step count and MLflow run tagged with its source.
    init = load_warm_start(cfg.init_from) if cfg.get("init_from") else None
    if init is not None:
        for change in adopt_model_config(cfg, init["model_config"]):
            log.warning("init_from sets %s", change)
    mcfg = model_config(cfg)  # ValueError naming every bad model field
    check_learning_rate(cfg)
    check_no_dataset(cfg)
    ckpt_path = resolve_ckpt_path(cfg)  # ckpt_path=PATH | last, or this run dir's last.ckpt (auto_resume)
    meta = read_checkpoint_meta(ckpt_path) if ckpt_path else {}
    use_mlflow = mlflow_config(cfg) is not None
    if use_mlflow:
        check_tracking_uri(cfg.logger.mlflow.tracking_uri)  # unreachable server: fail now, not after training
        sweep = sweep_job_info()
        if sweep is not None:
            attach_to_sweep(cfg, sweep)  # a multirun job: a child run of the sweep's parent run
    datamodule: L.LightningDataModule = instantiate(cfg.data)
    datamodule.prepare_data()
    datamodule.setup("fit")  # opens and checks every shard
    eval_callback = build_eval_callback(cfg.get("eval"))  # unknown tasks / missing datasets fail here

    if cfg.get("print_config", True) and first_job():
        print_config_tree(cfg)
    L.seed_everything(cfg.seed, workers=True)
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")  # TF32 for the fp32 matmuls left outside autocast (A100 and later)

    # 2. Build the parts.
    model = T6LitModule(
        model_config=mcfg.__dict__,
        optimizer=instantiate(cfg.optimizer),
        scheduler=instantiate(cfg.lr_ablation.scheduler) if cfg.lr_ablation.get("scheduler") else None,
        compile=cfg.get("compile", False),
        run_config=OmegaConf.to_container(cfg, resolve=True),
        nonfinite_loss=cfg.get("nonfinite_loss", "stop"),
        loss_chunk_tokens=cfg.get("loss_chunk_tokens", 1024),
    )
    if init is not None:
        model.model.load_state_dict(init["state_dict"])  # a resume (ckpt_path) then overrides these weights
        if use_mlflow:
            with open_dict(cfg):
                cfg.logger.mlflow.tags.source_run_id = init["source"]["mlflow_run_id"] or ""
                cfg.logger.mlflow.tags.init_from = str(cfg.init_from)
                conv = init["conversion"]
                cfg.logger.mlflow.tags.conversion = f"{conv['target']} kv_heads={conv['kv_heads']} {conv['method']}"
    if meta.get("mlflow_run_id") and use_mlflow and cfg.logger.mlflow.run_id is None:
        cfg.logger.mlflow.run_id = meta["mlflow_run_id"]  # a resumed run logs into the same MLflow run
    loggers = instantiate_dict(cfg.get("logger"))
    callbacks = instantiate_dict(cfg.get("callbacks")) + ([eval_callback] if eval_callback else [])
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    trainer.accumulate_grad_batches = datamodule.accumulation(trainer.world_size)
    if trainer.accumulate_grad_batches > 1 and trainer.is_global_zero:
        log.info("gradient accumulation: %d micro-batches per optimizer step (data.global_batch_size=%d = "
                 "data.batch_size=%d x %d device(s) x %d)", trainer.accumulate_grad_batches, datamodule.global_batch_size,
                 datamodule.batch_size, trainer.world_size, trainer.accumulate_grad_batches)

    mlflow = next((lg for lg in loggers if isinstance(lg, MLFlowLogger)), None)
    checkpoint_dir = trainer.checkpoint_callback.dirpath if trainer.checkpoint_callback else ""
    if mlflow is not None and not meta.get("mlflow_run_id"):
        log_run_config(mlflow, cfg, str(checkpoint_dir), mcfg)
    elif mlflow is not None and trainer.is_global_zero:
        mlflow.experiment.update_run(mlflow.run_id, status="RUNNING")  # it was KILLED or FAILED when interrupted

    # 3. Train. SIGTERM (preemption) and Ctrl-C save last.ckpt (callbacks.PreemptionCheckpoint) and end
    # the MLflow run as KILLED before the SIGTERMException leaves, carrying the signal as `signum`;
    # the resumed run sets it running again.
    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    except SIGTERMException as stop:
        if mlflow is not None and trainer.is_global_zero and mlflow.run_id:
            mlflow.experiment.set_tag(mlflow.run_id, "last_step", str(trainer.global_step))
            mlflow.experiment.set_terminated(mlflow.run_id, "KILLED")
        preemption = next((cb for cb in trainer.callbacks if isinstance(cb, PreemptionCheckpoint)), None)
        stop.signum = preemption.signum if preemption is not None else signal.SIGTERM
        raise
    else:
        if mlflow is not None and trainer.is_global_zero:
            mlflow.experiment.set_tag(mlflow.run_id, "last_step", str(trainer.global_step))  # for report.py
        save_and_upload_model(trainer, mlflow, checkpoint_dir)  # logger.mlflow.log_model: final | last | false
    finally:
        destroy_process_group()  # a sweep's next job in this process starts its own group

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if eval_callback is not None and eval_callback.history:
        metrics.update(eval_callback.history[-1][1])  # the last downstream evaluation (rank 0)
    objects = {"cfg": cfg, "model": model, "datamodule": datamodule, "trainer": trainer, "mlflow": mlflow}
    return metrics, objects


def summary(metrics: dict[str, float], objects: dict[str, Any]) -> str:
    """The closing lines of a run: final validation numbers, checkpoint, how to open MLflow on it."""
    trainer, mlflow = objects["trainer"], objects["mlflow"]
    lines = []
    if "val/loss" in metrics:
        lines.append(f"final val/loss {metrics['val/loss']:.4f}   val/ppl {metrics['val/ppl']:.2f}")
    for key in sorted(k for k in metrics if k.startswith("eval/") and k.endswith("/avg")):
        lines.append(f"{key:<15} {metrics[key]:.4f}   (per task: eval/{key.split('/')[1]}/<task>/<metric> in MLflow)")
    if trainer.checkpoint_callback and trainer.checkpoint_callback.last_model_path:
        lines.append(f"checkpoint      {trainer.checkpoint_callback.last_model_path}")
    if mlflow is not None:
        lines.append(f"MLflow run      {mlflow.run_id} (experiment {mlflow.experiment_id})")
        lines.append(
            f"open it with    mlflow ui --backend-store-uri {mlflow._tracking_uri} --port 5000   "
            f"then http://127.0.0.1:5000/#/experiments/{mlflow.experiment_id}/runs/{mlflow.run_id}"
        )
    return "\n".join(lines)
