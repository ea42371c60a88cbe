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

from t6 import memory
from t6.callbacks import PreemptionCheckpoint, SameMicroBatch
from t6.checkpoint import resolve_ckpt_path
from t6.config import flatten, model_config
from t6.data.batching import accumulation_steps, check_batch_settings, sequences_per_step
from t6.distributed import destroy_process_group
from t6.evaluation.callback import build_eval_callback
from t6.model.facts import model_facts
from t6.model.load import HF_FORMAT, WARM_START_FORMAT, read_checkpoint
from t6.model.loss import use_liger
from t6.module import T6LitModule
from t6.quiet import quiet_libraries
from t6.samples import SAMPLES_ARTIFACT, check_samples, log_samples
from t6.sweep import attach_to_sweep, sweep_job_info
from t6.tracking import (
    SystemMetrics,
    check_tracking_uri,
    mlflow_config,
    save_and_upload_model,
    tag_training_experiment,
    ui_path,
)
from t6.uptrain.convert import load_warm_start
from t6.uptrain.recipe import adopt_model_config

log = logging.getLogger(__name__)


def instantiate_dict(group: DictConfig | None) -> list[Any]:
    """Instantiate every `_target_` entry of a dict-of-configs group (callbacks, loggers)."""
    if not group:
        return []
    return [instantiate(conf) for conf in group.values() if isinstance(conf, DictConfig) and "_target_" in conf]


def read_checkpoint_meta(ckpt_path: str) -> dict:
    """The plain-data entries of a checkpoint (no tensors loaded into memory, no pickled code run)."""
    ckpt = read_checkpoint(ckpt_path, "ckpt_path", mmap=True)  # a corrupted file fails here, naming it
    if ckpt.get("format") in (WARM_START_FORMAT, HF_FORMAT):
        kind = "a Hugging Face directory" if ckpt["format"] == HF_FORMAT else "a converted (warm-start) checkpoint"
        raise ValueError(f"ckpt_path={ckpt_path!r} is {kind}: start from it with init_from=")
    return {k: ckpt[k] for k in ("mlflow_run_id", "run_config", "global_step") if k in ckpt}


def choose_hardware(cfg: DictConfig) -> dict[str, str]:
    """Resolve trainer.precision=auto for the device trainer.accelerator will use (in cfg), and say why."""
    device, device_why = memory.choose_device(cfg.trainer.get("accelerator", "auto"))
    precision, precision_why = memory.choose_precision(cfg.trainer.get("precision", "auto"), device)
    with open_dict(cfg):
        cfg.trainer.precision = precision
    return {"device": device, "device_why": device_why, "precision": precision, "precision_why": precision_why}


def check_data_shape(cfg: DictConfig) -> None:
    """Batch settings and sequence length, named by their fields, before any data is read."""
    check_batch_settings(cfg.data.get("batch_size"), cfg.data.get("global_batch_size"), cfg.data.get("seq_len"))
    seq_len, block = cfg.data.get("seq_len"), cfg.size.block_size
    if isinstance(seq_len, int) and seq_len > block:
        raise ValueError(
            f"data.seq_len={seq_len} is longer than size.block_size={block}, the longest context the model is built "
            f"for (its positions and caches); set data.seq_len<={block} or size.block_size={seq_len}"
        )


def schedule_facts(cfg: DictConfig) -> dict[str, Any] | None:
    """Warmup, total steps and max/min learning rate of the configured schedule (None without one)."""
    sched = cfg.lr_ablation.get("scheduler")
    if not sched:
        return None
    return {
        "warmup": int(sched.warmup_steps),
        "total": int(sched.total_steps),
        "max_lr": float(sched.max_lr),
        "min_lr": float(sched.min_lr),
        "max_steps": int(cfg.trainer.max_steps),
    }


def describe_schedule(facts: dict[str, Any] | None) -> str:
    if facts is None:
        return "constant learning rate (no lr_ablation.scheduler)"
    peak = facts["max_lr"] * min(1.0, facts["max_steps"] / max(1, facts["warmup"]))
    text = (
        f"warmup {facts['warmup']} of {facts['total']} steps, learning rate 0 -> {facts['max_lr']:g} -> "
        f"{facts['min_lr']:g} (cosine)"
    )
    if facts["warmup"] >= facts["max_steps"]:
        text += f"; this run stops in warmup at {peak:g}"
    return text


def check_schedule(facts: dict[str, Any] | None) -> None:
    """Warn, before training, when the run never leaves warmup (it still runs: smoke tests do this)."""
    if facts and facts["warmup"] >= facts["max_steps"]:
        log.warning(
            "lr_ablation.warmup_steps=%d >= trainer.max_steps=%d: the run ends in warmup and never reaches "
            "lr_ablation.max_lr=%g (nor decays to min_lr); raise trainer.max_steps above the warmup or lower "
            "lr_ablation.warmup_steps (e.g. lr_ablation.warmup_steps=%d)",
            facts["warmup"],
            facts["max_steps"],
            facts["max_lr"],
            max(1, facts["max_steps"] // 10),
        )


def plan_micro_batch(
    cfg: DictConfig, mcfg, trainer: L.Trainer, datamodule, hardware: dict[str, str], model: torch.nn.Module
) -> memory.MicroBatch | None:
    """The memory preflight: the micro-batch (auto or checked) and its accumulation, before fit."""
    world = trainer.world_size
    per_device = datamodule.per_device_batch(world)
    requested = datamodule.batch_size
    if requested != "auto":
        accumulation_steps(requested, datamodule.global_batch_size, world)  # raises when it does not divide
    device = hardware["device"]
    if not cfg.get("preflight", True) or device not in ("cpu", "cuda"):
        if requested == "auto":
            raise ValueError(
                f"data.batch_size=auto needs the memory preflight (preflight=true, a cpu or cuda device; "
                f"here preflight={cfg.get('preflight', True)}, device {device}); give data.batch_size a number"
            )
        return None
    strategy = cfg.trainer.get("strategy")
    fsdp = (
        isinstance(strategy, DictConfig) and "fsdp" in str(strategy.get("_target_", "")).lower() or strategy == "fsdp"
    )
    checkpointing = bool(isinstance(strategy, DictConfig) and strategy.get("activation_checkpointing"))
    shards = world if fsdp else 1
    bucket_view = bool(isinstance(strategy, DictConfig) and strategy.get("gradient_as_bucket_view"))
    ddp_buckets = world > 1 and not fsdp and not bucket_view  # data parallel: DDP, whatever named it
    if device == "cuda":
        index = trainer.strategy.root_device.index or 0
        available, source = memory.available_memory("cuda", index)
        runtime = 0
    else:
        available, source = memory.available_memory("cpu")
        local = max(1, trainer.num_devices)
        if local > 1:
            available, source = available // local, f"{source} shared by {local} processes"
        # the process as it stands, less the model already built here (the estimate counts its parameters)
        built = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cpu")
        runtime = max(0, memory.process_rss() - built)
    ways_out = (
        "a smaller data.batch_size (or data.batch_size=auto with data.global_batch_size), "
        "trainer=fsdp with trainer.strategy.activation_checkpointing=true, trainer=fsdp over more devices "
        "(trainer.devices), or a smaller size"
    )

    def estimate(batch: int) -> memory.StepMemory:
        return memory.estimate_step_memory(
            mcfg,
            batch,
            int(cfg.data.seq_len),
            precision=hardware["precision"],
            optimizer_target=cfg.optimizer._target_,
            shards=shards,
            activation_checkpointing=checkpointing,
            device=device,
            runtime=runtime,
            loss_chunk_tokens=cfg.get("loss_chunk_tokens"),
            liger=use_liger(cfg.get("loss_impl", "auto"), device),
            ddp_buckets=ddp_buckets,
        )

    return memory.fit_micro_batch(estimate, requested, per_device, available, source, ways_out)


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
        raise ValueError(
            "dataset= chooses what prepare.py tokenizes; prepare it (python prepare.py dataset=local "
            "dataset.data_files=FILE.jsonl), then train on the shards with data=local (or data=fineweb_edu)"
        )


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


def log_run_config(logger: MLFlowLogger, cfg: DictConfig, checkpoint_dir: str, mcfg) -> None:
    """Once per run: the flattened, resolved config as params, the model's size and KV cache per
    token (`model/...`, measured on the built model, cache in bf16) for the report, the YAML as an
    artifact, the checkpoint dir as a tag."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    facts = model_facts(mcfg)  # KV cache counted in bf16
    logger.log_hyperparams({**flatten(resolved), **{f"model/{k}": v for k, v in facts.items()}})
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
    check_data_shape(cfg)
    check_samples(cfg)
    hardware = choose_hardware(cfg)  # trainer.precision=auto -> what the device supports
    use_liger(cfg.get("loss_impl", "auto"), hardware["device"])  # an unknown or impossible loss_impl
    schedule = schedule_facts(cfg)
    check_schedule(schedule)
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
        loss_chunk_tokens=cfg.get("loss_chunk_tokens"),
        loss_impl=cfg.get("loss_impl", "auto"),
    )
    if init is not None:
        model.model.load_state_dict(init["state_dict"])  # a resume (ckpt_path) then overrides these weights
        if use_mlflow:
            with open_dict(cfg):
                cfg.logger.mlflow.tags.source_run_id = init["source"]["mlflow_run_id"] or ""
                cfg.logger.mlflow.tags.init_from = str(cfg.init_from)
                conv = init.get("conversion")  # a converted checkpoint's; a Hugging Face directory has none
                if conv:
                    cfg.logger.mlflow.tags.conversion = f"{conv['target']} kv_heads={conv['kv_heads']} {conv['method']}"
    if meta.get("mlflow_run_id") and use_mlflow and cfg.logger.mlflow.run_id is None:
        cfg.logger.mlflow.run_id = meta["mlflow_run_id"]  # a resumed run logs into the same MLflow run
    loggers = instantiate_dict(cfg.get("logger"))  # an MLflow run is created on first use, after the preflight
    callbacks = instantiate_dict(cfg.get("callbacks")) + ([eval_callback] if eval_callback else [])
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)

    # The memory preflight decides the micro-batch (data.batch_size=auto) or checks the given one;
    # the global batch, hence the optimization, stays data.global_batch_size through accumulation.
    plan = plan_micro_batch(cfg, mcfg, trainer, datamodule, hardware, model)
    if plan is not None:
        datamodule.batch_size = plan.batch
        if plan.auto and trainer.world_size > 1:  # each rank planned alone: they compare plans at setup
            trainer.callbacks.append(SameMicroBatch(plan.batch, plan.available))
    with open_dict(cfg):
        cfg.data.batch_size = datamodule.batch_size  # logged, and stored in checkpoints, as the number used
    accumulate = datamodule.accumulation(trainer.world_size)
    trainer.accumulate_grad_batches = accumulate
    if accumulate > 1 and trainer.is_global_zero:
        log.info(
            "gradient accumulation: %d micro-batches per optimizer step (data.global_batch_size=%d = "
            "data.batch_size=%d x %d device(s) x %d)",
            accumulate,
            datamodule.global_batch_size,
            datamodule.batch_size,
            trainer.world_size,
            accumulate,
        )
    if isinstance(trainer.val_check_interval, int):
        trainer.val_check_interval *= accumulate  # Lightning counts micro-batches; the config counts optimizer steps
    announce(cfg, hardware, plan, datamodule, trainer, schedule)

    model.run_config = OmegaConf.to_container(cfg, resolve=True)
    mlflow = next((lg for lg in loggers if isinstance(lg, MLFlowLogger)), None)
    checkpoint_dir = trainer.checkpoint_callback.dirpath if trainer.checkpoint_callback else ""
    if mlflow is not None and trainer.is_global_zero:
        tag_training_experiment(mlflow.experiment, mlflow.experiment_id)  # MLflow's UI: the model-training view
    if mlflow is not None and not meta.get("mlflow_run_id"):
        log_run_config(mlflow, cfg, str(checkpoint_dir), mcfg)
    elif mlflow is not None and trainer.is_global_zero:
        mlflow.experiment.update_run(mlflow.run_id, status="RUNNING")  # it was KILLED or FAILED when interrupted
    system = None
    interval = getattr(mlflow, "t6_system_metrics", None) if mlflow is not None else None
    if interval and trainer.local_rank == 0:  # one monitor per node
        node = f"node{trainer.node_rank}" if trainer.num_nodes > 1 else None
        system = SystemMetrics(
            mlflow.run_id, mlflow._tracking_uri, interval, resume=bool(meta.get("mlflow_run_id")), node_id=node
        )

    # 3. Train. SIGTERM (preemption) and Ctrl-C save last.ckpt (callbacks.PreemptionCheckpoint) and end
    # the MLflow run as KILLED before the SIGTERMException leaves, carrying the signal as `signum`;
    # the resumed run sets it running again.
    try:
        if system is not None:
            system.__enter__()
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
        samples = log_samples(cfg, trainer, model.model, mlflow)
    finally:
        if system is not None:
            system.__exit__()
        destroy_process_group()  # a sweep's next job in this process starts its own group

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if eval_callback is not None and eval_callback.history:
        metrics.update(eval_callback.history[-1][1])  # the last downstream evaluation (rank 0)
    objects = {
        "cfg": cfg,
        "model": model,
        "datamodule": datamodule,
        "trainer": trainer,
        "mlflow": mlflow,
        "hardware": hardware,
        "plan": plan,
        "schedule": schedule,
        "samples": samples,
    }
    return metrics, objects


@rank_zero_only
def announce(cfg: DictConfig, hardware: dict, plan, datamodule, trainer: L.Trainer, schedule: dict | None) -> None:
    """The opening lines: device and precision and why, the batch and the memory it needs, the schedule."""
    world = trainer.world_size
    accumulate = trainer.accumulate_grad_batches
    per_step = sequences_per_step(datamodule.batch_size, datamodule.global_batch_size, world)
    lines = [
        f"device          {hardware['device']} ({hardware['device_why']}), precision {hardware['precision']} "
        f"({hardware['precision_why']})",
        f"batch           {per_step} sequences x {datamodule.seq_len} tokens per step = "
        f"micro-batch {datamodule.batch_size} x {accumulate} accumulation step(s) x {world} device(s)",
    ]
    if plan is not None:
        lines.append(f"memory          {plan.describe()}")
    lines.append(f"schedule        {describe_schedule(schedule)}")
    log.info("run plan\n%s", "\n".join(lines))


def summary(metrics: dict[str, float], objects: dict[str, Any]) -> str:
    """The closing lines of a run: final validation numbers, checkpoint, how to open MLflow on it."""
    trainer, mlflow = objects["trainer"], objects["mlflow"]
    lines = []
    if "val/loss" in metrics:
        lines.append(f"final val/loss {metrics['val/loss']:.4f}   val/ppl {metrics['val/ppl']:.2f}")
    for key in sorted(k for k in metrics if k.startswith("eval/") and k.endswith("/avg")):
        lines.append(f"{key:<15} {metrics[key]:.4f}   (per task: eval/{key.split('/')[1]}/<task>/<metric> in MLflow)")
    lines.append(f"schedule        {describe_schedule(objects.get('schedule'))}; {trainer.global_step} steps run")
    if objects.get("samples"):
        where = f" (every prompt: {SAMPLES_ARTIFACT} in MLflow)" if mlflow is not None else ""
        lines.append(f"sample          greedy{where}")
        lines.extend(f"    {line}" for line in objects["samples"][0].splitlines())
    ckpt = trainer.checkpoint_callback
    final = (getattr(ckpt, "final_path", None) or ckpt.last_model_path or None) if ckpt else None
    if final:
        lines.append(f"checkpoint      {final}   (ckpt_path=last in this run dir resumes from it)")
    if mlflow is not None:
        lines.append(f"MLflow run      {mlflow.run_id} (experiment {mlflow.experiment_id})")
        lines.append(
            f"open it with    mlflow ui --backend-store-uri {mlflow._tracking_uri} --port 5000   "
            f"then http://127.0.0.1:5000/{ui_path(mlflow.experiment_id, mlflow.run_id)}"
        )
    return "\n".join(lines)
