"""A run's whole plan as one value, computed before anything is built: `plan_run(cfg) -> RunPlan`.

    plan = plan_run(cfg)     # every decision and every check, no Trainer, nothing written
    print(plan.describe())   # what the run announces (and MLflow records, `plan.params()`)
    execute(plan)            # t6.run.execute: builds the plan's components and fits

The plan reads what it needs (the warm start, the checkpoint to resume from, the data's manifest, the
tracking store, the sweep file, the machine's memory) and writes nothing. It decides in this order:

1. the config's own problems, every one at once (`ConfigError`: the typed sections' own, t6.run.sections, and the
   rest of the config's, t6.run.checks);
2. the device, precision and compilation, and the processes (strategy, devices, nodes);
3. the schedule, the resume point, the data, the tracking target and the sweep parent;
4. the micro-batch and its accumulation, by the memory preflight (t6.training.step_memory);
5. how checkpoints are written and how often (t6.training.callbacks.checkpoint);
6. the components execute builds, each with every argument: the Trainer (its device, processes, strategy and
   precision the plan's), its plugins, the callbacks (the config's, the plan's arguments bound by their class,
   then the plan's own) and the loggers.

Each decision has one home, a field of `RunPlan`. `plan.cfg` is the config as given, never changed;
`plan.logged_cfg` is what MLflow and the checkpoints record: the config with a warm start's model shape, which the
decisions read.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from t6.data.batching import sequences_per_device, sequences_per_step, world_size
from t6.data.tokenizer import Tokenizer, checkpoint_tokenizer, load_tokenizer, mismatch, run_tokenizer
from t6.errors import ConfigError, NoRoom, SettingError
from t6.evaluation.callback import EvalSettings, check_eval_tasks
from t6.hardware import device as hw_device
from t6.hardware import probes
from t6.hardware.compile_cache import CacheState, cache_state
from t6.hydra_config import with_match
from t6.model.config import ModelConfig
from t6.model.load import HF_FORMAT, WARM_START_FORMAT, model_state
from t6.model.loss import use_liger
from t6.model.match import Match
from t6.run import checks
from t6.run.resume import checkpoint_dir, find_resume
from t6.run.samples import Samples
from t6.run.sections import Component, Sections, read_sections
from t6.tracking.mlflow import StoreUnreachable, check_tracking_store, log_model_choice, stored_steps
from t6.tracking.outbox import SYNC_COMMAND, logged_steps
from t6.tracking.sweep import sweep_job_info, sweep_job_run
from t6.training import step_memory as memory
from t6.training.callbacks import RunCheckpoint, ThroughputMonitor
from t6.uptrain import recipe


class Strategy(enum.Enum):
    """How the processes of a run share the work."""

    SINGLE = "single device"
    DDP = "DDP"  # data parallel: every process holds the whole model
    FSDP = "FSDP"  # fully sharded: parameters, gradients and optimizer state split across processes


@dataclass(frozen=True)
class Hardware:
    device: str  # "cuda" or "cpu"
    device_why: str
    precision: str  # Lightning's precision string, e.g. bf16-mixed
    precision_why: str
    compile: bool = False  # each block compiled (T6.compile_blocks)
    compile_why: str = ""
    peak_flops: float = 0.0  # the device's dense peak FLOP/s at the compute dtype: MFU's denominator
    peak_why: str = ""
    compile_cache: CacheState | None = None  # torch.compile's cache folder (paths.compile_cache_dir) as it was

    def describe_compile(self) -> str:
        if not self.compile:
            return f"off ({self.compile_why})"
        expect = hw_device.EXPECTED_COMPILE_S.get(self.device)
        expected = f"expect ~{expect:.0f} s, " if expect else ""
        first = f"the first step and the first validation compile ({expected}logged as perf/compile_s)"
        cache = f"; {self.compile_cache.describe()}" if self.compile_cache is not None else ""
        return f"on ({self.compile_why}); {first}{cache}"


@dataclass(frozen=True)
class Parallel:
    """The processes: one per device, `devices` per node on `nodes` nodes, and how they share the work (`strategy`;
    `lightning_strategy`: what the Trainer is given, a Lightning strategy name or the config's `_target_` node)."""

    strategy: Strategy
    devices: int
    nodes: int
    device_index: int  # this process's device on its node (CUDA)
    activation_checkpointing: bool = False
    bucket_view: bool = False  # DDP's gradients are views into its all-reduce buckets
    device_ids: tuple[int, ...] | None = None  # trainer.devices as a list of ids; None: the first `devices`
    lightning_strategy: str | Component = "auto"

    @property
    def world_size(self) -> int:
        return self.devices * self.nodes

    @property
    def shards(self) -> int:
        return self.world_size if self.strategy is Strategy.FSDP else 1

    @property
    def ddp_buckets(self) -> bool:
        """DDP keeps all-reduce buckets beside the gradients (a second copy of them)."""
        return self.world_size > 1 and self.strategy is not Strategy.FSDP and not self.bucket_view


@dataclass(frozen=True)
class BatchPlan:
    seq_len: int
    micro_batch: int
    accumulation: int
    per_step: int  # sequences per optimizer step, all devices
    world_size: int
    memory: memory.MicroBatch | None  # the preflight's estimate (None: preflight=false)

    def describe(self) -> str:
        return (
            f"{self.per_step} sequences x {self.seq_len} tokens per step = micro-batch {self.micro_batch} x "
            f"{self.accumulation} accumulation step(s) x {self.world_size} device(s)"
        )


@dataclass(frozen=True)
class Schedule:
    warmup: int
    total: int
    max_lr: float
    min_lr: float
    max_steps: int
    scheduler: Component | None = None  # lr_ablation.scheduler, built by execute with the four numbers above

    def describe(self) -> str:
        lr = f"learning rate 0 -> {self.max_lr:g} -> {self.min_lr:g} (cosine)"
        text = f"warmup {self.warmup} of {self.total} steps, {lr}"
        if self.warmup >= self.max_steps:
            text += f"; this run stops in warmup at {self.max_lr * min(1.0, self.max_steps / max(1, self.warmup)):g}"
        return text

    def warning(self) -> str | None:
        """Said before training when the run never leaves warmup (it still runs: smoke tests do this)."""
        if self.warmup < self.max_steps:
            return None
        lower = max(1, self.max_steps // 10)
        fix = f"raise trainer.max_steps above {self.warmup}"
        if lower < self.warmup:
            fix += f" or lower lr_ablation.warmup_steps (e.g. lr_ablation.warmup_steps={lower})"
        return (
            f"lr_ablation.warmup_steps={self.warmup} >= trainer.max_steps={self.max_steps}: the run ends in warmup "
            f"and never reaches lr_ablation.max_lr={self.max_lr:g} (nor decays to min_lr); {fix}"
        )


@dataclass(frozen=True)
class Checkpoints:
    every_n_steps: int | None  # periodic saves (0: none, last.ckpt at the end and on SIGTERM; None: at validations)
    why: str
    background: bool  # written by a thread from a host copy (t6.training.checkpoint_io)

    def describe(self) -> str:
        when = {0: "at the end only", None: "after every validation"}.get(
            self.every_n_steps, f"every {self.every_n_steps} step{'s' if self.every_n_steps != 1 else ''}"
        )
        how = "in the background" if self.background else "synchronously"
        return f"{when}, written {how} ({self.why})"


@dataclass(frozen=True)
class Resume:
    ckpt_path: str
    step: int
    mlflow_run_id: str | None
    how: str  # which setting chose it: ckpt_path=PATH, ckpt_path=last or auto_resume
    passed_over: tuple[str, ...] = ()  # newer files of the run directory that do not read whole

    def describe(self) -> str:
        return f"from step {self.step} of {self.ckpt_path} ({self.how})"


@dataclass(frozen=True)
class WarmStart:
    path: str
    source_run_id: str
    conversion: str
    changes: tuple[str, ...]  # the size/attention settings the converted model set
    model: ModelConfig | None = None  # the converted model's shape, which the run trains

    def describe(self) -> str:
        return f"weights of {self.path} ({self.conversion}; source run {self.source_run_id or 'unknown'})"


@dataclass(frozen=True)
class Tracking:
    uri: str
    experiment: str
    run_name: str
    run_id: str | None  # the MLflow run a resume continues; None: a new run
    sweep_parent: str | None
    system_metrics_s: float | None
    upload: str | None  # logger.mlflow.log_model: final, last or None
    outbox_dir: str  # where writes wait for the store
    unreachable: str | None = None  # a resume found the server down: why (the run logs to its outbox meanwhile)
    tags: dict = field(default_factory=dict)  # the run's tags: the config's, a sweep job's, a warm start's
    logged: dict = field(default_factory=dict)  # a continued run's highest step of each metric: not logged twice
    flush_timeout_s: float = 30.0  # how long the end of the run waits for an unreachable store

    def describe(self) -> str:
        run = f"continues run {self.run_id}" if self.run_id else f"new run {self.run_name!r}"
        sweep = f", child of sweep run {self.sweep_parent}" if self.sweep_parent else ""
        text = f"MLflow {self.uri}, experiment {self.experiment!r}, {run}{sweep}"
        if self.unreachable:
            text += f"\n                {self.offline_note()}"
        return text

    def offline_note(self) -> str:
        return (
            f"the server is unreachable ({self.unreachable}): training goes on, logging to {self.outbox_dir}, sent "
            f"to the server when it answers; what is left at the end: {SYNC_COMMAND} {self.outbox_dir}"
        )


@dataclass(frozen=True)
class Training:
    """How the module trains: what execute hands T6LitModule and the Trainer."""

    seed: int
    nonfinite_loss: str  # stop or skip
    loss_impl: str  # liger or chunked (loss_impl=auto decided for the device)
    loss_chunk_tokens: int | None
    max_steps: int
    val_check_interval: int | float | None  # in micro-batches (the config counts optimizer steps)
    optimizer_args: dict = field(default_factory=dict)  # beside the optimizer group's: AdamW fused on CUDA
    gradient_checkpointing: bool = False  # every block recomputed in backward (T6.gradient_checkpointing)
    teacher: str | None = None  # a model whose logits the loss also follows (KL), e.g. a conversion's source
    teacher_kl_weight: float = 0.5  # w in (1 - w) CE + w KL(teacher || model)


@dataclass(frozen=True)
class RunPlan:
    cfg: DictConfig  # the config as given, never changed (see the module docstring)
    logged_cfg: DictConfig  # what MLflow and the checkpoints record: the config with a warm start's model shape
    model: ModelConfig
    hardware: Hardware
    parallel: Parallel
    batch: BatchPlan
    schedule: Schedule | None
    resume: Resume | None
    warm_start: WarmStart | None
    tracking: Tracking | None
    training: Training
    run_dir: str  # the run's directory (paths.output_dir), held by one run at a time
    checkpoint_dir: str  # where last.ckpt goes (the checkpoint callback's, and the stop protocol's)
    trainer: Component  # lightning.Trainer (the config's `_target_`) with every argument but the objects below
    plugins: tuple[Component, ...]  # the Trainer's plugins (checkpoint IO, background as decided)
    callbacks: tuple[Component, ...]  # the config's callbacks, the plan's arguments bound, then the plan's own
    loggers: tuple[Component, ...]  # MLflow's (the run the plan chose) and the config's others
    checkpoints: Checkpoints | None = None  # None: no checkpoint callback
    evaluation: EvalSettings | None = None  # the eval group, checked (None: eval=none)
    samples: Samples | None = None  # the greedy samples after training, checked (None: samples=null)
    warnings: tuple[str, ...] = field(default=())
    tokenizer: Tokenizer | None = None  # the run's (cfg.tokenizer, resolved): data, evaluation, samples, checkpoints
    match: Match | None = None  # the match group solved (t6.hydra_config.with_match): its sizes are in cfg already

    def describe(self) -> str:
        """The opening lines of a run: what it will do and why."""
        hw, par = self.hardware, self.parallel
        lines = [
            f"device          {hw.device} ({hw.device_why}), precision {hw.precision} ({hw.precision_why})",
            f"processes       {par.world_size} ({par.strategy.value}: {par.devices} device(s) x {par.nodes} node(s))",
            f"compile         {hw.describe_compile()}",
            f"peak            {hw.peak_flops / 1e12:.4g} TFLOP/s ({hw.peak_why}): MFU's denominator",
            f"batch           {self.batch.describe()}",
        ]
        if self.batch.memory is not None:
            lines.append(f"memory          {self.batch.memory.describe()}")
        schedule = self.schedule.describe() if self.schedule else "constant learning rate (no lr_ablation.scheduler)"
        lines.append(f"schedule        {schedule}")
        if self.checkpoints is not None:
            lines.append(f"checkpoints     {self.checkpoints.describe()}")
        if self.resume is not None:
            lines.append(f"resume          {self.resume.describe()}")
        if self.warm_start is not None:
            lines.append(f"warm start      {self.warm_start.describe()}")
        if self.tokenizer is not None:
            tok = self.tokenizer
            lines.append(f"tokenizer       {tok.name} ({tok.n_vocab:,} tokens, {tok.id})")
        if self.tracking is not None:
            lines.append(f"tracking        {self.tracking.describe()}")
        if self.match is not None:
            lines.append(f"match           {self.match.describe()}")
        return "\n".join(lines)

    def params(self) -> dict[str, Any]:
        """The plan's decisions as MLflow parameters (plan/...), beside the resolved config."""
        out = {
            "plan/device": self.hardware.device,
            "plan/precision": self.hardware.precision,
            "plan/compile": self.hardware.compile,
            "plan/loss_impl": self.training.loss_impl,
            "plan/strategy": self.parallel.strategy.name.lower(),
            "plan/world_size": self.parallel.world_size,
            "plan/micro_batch": self.batch.micro_batch,
            "plan/accumulation": self.batch.accumulation,
            "plan/sequences_per_step": self.batch.per_step,
        }
        if self.batch.memory is not None:
            out["plan/memory_estimate_gib"] = round(self.batch.memory.estimate.total / probes.GIB, 2)
        if self.checkpoints is not None:
            out["plan/checkpoint_every_n_steps"] = str(self.checkpoints.every_n_steps)
            out["plan/checkpoint_background"] = self.checkpoints.background
        if self.hardware.peak_flops:
            out["plan/peak_tflops"] = round(self.hardware.peak_flops / 1e12, 4)
        if self.tokenizer is not None:
            out.update({"tokenizer/id": self.tokenizer.id, "tokenizer/name": self.tokenizer.name})
            out["tokenizer/n_vocab"] = self.tokenizer.n_vocab
        return out | (self.match.params() if self.match is not None else {})


def plan_run(cfg: DictConfig) -> RunPlan:
    """Every decision a training run makes before the Trainer exists, and every check (see the module docstring)."""
    given = copy.deepcopy(cfg)  # resolvers and the checks read it; nothing writes into it but the match:
    given, match = with_match(given)  # the match group's solved sizes (size.n_head, attention.options.*)
    warm = plan_warm_start(given)
    # A warm start's model shape is the run's: what follows size.* (data.seq_len's ${size.block_size}, the uptrain
    # recipe's step count, the MLflow run's name) follows it. The decisions below read this copy.
    cfg = recipe.with_model_config(given, asdict(warm.model)) if warm is not None else given
    tokenizer = plan_tokenizer(cfg)  # tokenizer=null: init_from's own, else GPT-2
    sections, problems = read_sections(cfg)
    mcfg, more = checks.config_problems(cfg, sections, tokenizer)
    if more + problems:
        raise ConfigError("Invalid run config", more + problems)
    if warm is not None:
        mcfg = warm.model
    hardware = choose_hardware(cfg, sections)
    parallel = plan_parallel(sections, hardware)
    schedule = plan_schedule(sections)
    folder = checkpoint_dir(cfg.paths.output_dir, sections.callback(RunCheckpoint))
    resume = plan_resume(cfg, folder, mcfg, tokenizer)
    tracking = plan_tracking(sections, resume, warm)
    instantiate_data(cfg, tokenizer).check()  # the shards exist and are whole (or the text they are made from does)
    evaluation = EvalSettings.read(cfg.get("eval"))
    check_eval_tasks(evaluation)  # unknown tasks, missing datasets
    batch = plan_batch(cfg, sections, mcfg, hardware, parallel)
    training = plan_training(cfg, sections, hardware, parallel, batch)
    background = checkpoint_background(sections, hardware, parallel)
    checkpoints = plan_checkpoints(cfg, sections, mcfg, hardware, batch, background)
    warnings = tuple(f"init_from sets {change}" for change in (warm.changes if warm else ()))
    warnings += tuple(w for w in [schedule.warning() if schedule else None] if w)
    warnings += (tracking.offline_note(),) if tracking is not None and tracking.unreachable else ()
    warnings += tuple(f"resume: passed over {name}" for name in (resume.passed_over if resume else ()))
    return RunPlan(
        given,
        cfg,
        mcfg,
        hardware,
        parallel,
        batch,
        schedule,
        resume,
        warm,
        tracking,
        training,
        str(cfg.paths.output_dir),
        str(folder),
        trainer_component(cfg, sections, hardware, parallel, batch, training),
        plan_plugins(sections, background),
        plan_callbacks(sections, hardware, parallel, batch, tracking, checkpoints, folder),
        plan_loggers(sections, tracking),
        checkpoints,
        evaluation,
        Samples.read(cfg),
        warnings,
        tokenizer,
        match=match,
    )


# ------------------------------------------------------------------------------------ what execute builds


def trainer_component(
    cfg: DictConfig, sections: Sections, hardware: Hardware, parallel: Parallel, batch: BatchPlan, training: Training
) -> Component:
    """lightning.Trainer (the config's `_target_`) with the plan's device, processes, precision and length, the
    accumulation that keeps data.global_batch_size, validation counted in micro-batches, and the config's other
    settings as given."""
    trainer = sections.trainer
    return Component(
        "trainer",
        str(cfg.trainer._target_),
        {
            **trainer.others,
            "accelerator": hardware.device,
            "devices": list(parallel.device_ids) if parallel.device_ids is not None else parallel.devices,
            "num_nodes": parallel.nodes,
            "precision": hardware.precision,
            "max_steps": training.max_steps,
            "val_check_interval": training.val_check_interval,
            "accumulate_grad_batches": batch.accumulation,
            "log_every_n_steps": trainer.log_every_n_steps,
            "gradient_clip_val": trainer.gradient_clip_val,
        },
    )


def plan_plugins(sections: Sections, background: bool) -> tuple[Component, ...]:
    """The Trainer's plugins as configured, the checkpoint IO told whether to write in the background."""
    from t6.training.checkpoint_io import BackgroundCheckpointIO

    return tuple(
        p.with_arguments(background=background) if p.builds(BackgroundCheckpointIO) else p
        for p in sections.trainer.plugins
    )


def plan_callbacks(
    sections: Sections,
    hardware: Hardware,
    parallel: Parallel,
    batch: BatchPlan,
    tracking: Tracking | None,
    checkpoints: Checkpoints | None,
    folder: Path,
) -> tuple[Component, ...]:
    """The config's callbacks, each with the arguments the plan decided for its class (found by class, whatever its
    key in the config), then the plan's own: the system metrics of every node, the ranks' micro-batch check, the
    stop protocol (always last: it saves last.ckpt after every other callback's step end). The downstream
    evaluation is built from `RunPlan.evaluation` (it writes its tasks when built)."""
    decided = {
        ThroughputMonitor: {"peak_tflops": hardware.peak_flops / 1e12, "peak_source": hardware.peak_why},
        RunCheckpoint: {"every_n_train_steps": checkpoints.every_n_steps} if checkpoints is not None else {},
    }
    out = [
        c.with_arguments(**next((args for cls, args in decided.items() if c.builds(cls)), {}))
        for c in sections.callbacks
    ]
    if tracking is not None and tracking.system_metrics_s:  # one monitor per node
        out.append(Component("system_metrics", SYSTEM_METRICS, {"interval_s": tracking.system_metrics_s}))
    if batch.memory is not None and batch.memory.auto and parallel.world_size > 1:  # the ranks compare their plans
        out.append(Component("same_micro_batch", SAME_MICRO_BATCH, {"batch": batch.micro_batch,
                                                                     "available": batch.memory.available}))  # fmt: skip
    out.append(Component("stop_protocol", STOP_PROTOCOL, {"path": str(folder / "last.ckpt")}))
    return tuple(out)


# The plan's own callbacks, by the import path their Components build.
SYSTEM_METRICS = "t6.tracking.system_metrics.SystemMetrics"
SAME_MICRO_BATCH = "t6.training.callbacks.SameMicroBatch"
STOP_PROTOCOL = "t6.training.stop.StopProtocol"


def plan_loggers(sections: Sections, tracking: Tracking | None) -> tuple[Component, ...]:
    """MLflow's logger for the run the plan chose (its name, tags, the run a resume continues), then the config's
    other loggers."""
    out = list(sections.loggers)
    if tracking is not None:
        mlflow = sections.mlflow
        arguments = {
            "experiment_name": tracking.experiment,
            "run_name": tracking.run_name,
            "tracking_uri": tracking.uri,
            "outbox_dir": tracking.outbox_dir,
            "artifact_dir": mlflow.artifact_dir,
            "log_model": mlflow.log_model,
            "tags": tracking.tags,
            "run_id": tracking.run_id,
            "continue_run": mlflow.continue_run,
            "system_metrics": mlflow.system_metrics,
            "system_metrics_interval_s": mlflow.system_metrics_interval_s,
            "flush_timeout_s": tracking.flush_timeout_s,
            "logged_steps": tracking.logged,
        }
        out.insert(0, Component("mlflow", mlflow.target, arguments))
    return tuple(out)


# ------------------------------------------------------------------------------------ decisions


def choose_hardware(cfg: DictConfig, sections: Sections) -> Hardware:
    """trainer.accelerator -> the device; trainer.precision=auto -> what that device computes fast;
    compile=auto -> whether compiling pays there; the device's peak FLOP/s (the throughput callback's
    peak_tflops where the config gives it)."""
    trainer = sections.trainer
    device, device_why = hw_device.choose_device(trainer.accelerator)
    precision, precision_why = hw_device.choose_precision(trainer.precision, device)
    compile_, compile_why = hw_device.choose_compile(cfg.get("compile", "auto"), device)
    if device == "cuda" and not hw_device.cuda_available():
        raise ConfigError(
            "No CUDA device",
            [
                f"trainer.accelerator={trainer.accelerator}: this machine has no CUDA GPU; use trainer=default "
                "(accelerator auto: the GPU when there is one, else the CPU) or trainer=cpu"
            ],
        )
    throughput = sections.callback(ThroughputMonitor)
    given = throughput.arguments.get("peak_tflops") if throughput is not None else None
    if given:
        peak, peak_why = float(given) * 1e12, f"callbacks.{throughput.name}.peak_tflops"
    else:
        peak, peak_why = hw_device.peak_flops(device, hw_device.compute_dtype(precision))
    cache_dir = cfg.paths.get("compile_cache_dir") if "paths" in cfg else None
    cache = cache_state(cache_dir) if compile_ and cache_dir else None
    return Hardware(device, device_why, precision, precision_why, compile_, compile_why, peak, peak_why, cache)


def strategy_kind(strategy: str | Component | None, world: int) -> Strategy:
    """The kind of a `trainer.strategy` setting: a Lightning strategy name, a `_target_` node, or auto.
    Read from the class it names (FSDPStrategy, DDPStrategy and their subclasses), never from the text."""
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy, StrategyRegistry

    if strategy in (None, "auto"):
        return Strategy.SINGLE if world == 1 else Strategy.DDP
    if isinstance(strategy, Component):
        cls = strategy.kind()
    elif isinstance(strategy, str) and strategy in StrategyRegistry:
        cls = StrategyRegistry[strategy]["strategy"]
    else:
        raise ConfigError("Unknown strategy", [f"trainer.strategy={strategy!r} is not a Lightning strategy name"])
    for base, kind in (
        (FSDPStrategy, Strategy.FSDP),
        (DDPStrategy, Strategy.DDP),
        (SingleDeviceStrategy, Strategy.SINGLE),
    ):
        if isinstance(cls, type) and issubclass(cls, base):
            return kind
    raise ConfigError(
        "Unsupported strategy",
        [f"trainer.strategy={strategy!r}: a run is planned for one device, DDP or FSDP (trainer=ddp, trainer=fsdp)"],
    )


def count_devices(devices: Any, device: str) -> int:
    """trainer.devices as a number of processes per node: a count, a list of ids, or auto / -1 (every
    device of the accelerator, as Lightning counts them)."""
    if devices in ("auto", -1, "-1"):
        from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator

        return (CUDAAccelerator if device == "cuda" else CPUAccelerator).auto_device_count()
    if isinstance(devices, str):
        devices = [d for d in devices.split(",") if d.strip()] if "," in devices else int(devices)
    count = world_size(list(devices) if isinstance(devices, (list, tuple)) else devices, 1)
    if count is None:
        raise ConfigError("Invalid devices", [f"trainer.devices={devices!r} must be a count, a list of ids or auto"])
    return count


def plan_parallel(sections: Sections, hardware: Hardware) -> Parallel:
    trainer = sections.trainer
    devices = count_devices(trainer.devices, hardware.device)
    ids = trainer.devices
    if isinstance(ids, str) and "," in ids:
        ids = [int(d) for d in ids.split(",") if d.strip()]
    ids = tuple(int(i) for i in ids) if isinstance(ids, (list, tuple)) else None
    local = probes.env_local_rank()
    index = ids[local] if ids is not None and local < len(ids) else local
    return Parallel(
        strategy_kind(trainer.strategy, devices * trainer.num_nodes),
        devices,
        trainer.num_nodes,
        index,
        activation_checkpointing=bool(trainer.strategy_option("activation_checkpointing", False)),
        bucket_view=bool(trainer.strategy_option("gradient_as_bucket_view", False)),
        device_ids=ids,
        lightning_strategy=trainer.strategy if trainer.strategy is not None else "auto",
    )


def plan_schedule(sections: Sections) -> Schedule | None:
    lr = sections.schedule
    if lr.scheduler is None:
        return None
    s = lr.scheduler.arguments
    return Schedule(
        int(s["warmup_steps"]),
        int(s["total_steps"]),
        float(s["max_lr"]),
        float(s["min_lr"]),
        int(sections.trainer.max_steps),
        lr.scheduler,
    )


def plan_resume(cfg: DictConfig, folder: Path, mcfg: ModelConfig, tokenizer: Tokenizer | None = None) -> Resume | None:
    """The checkpoint to continue from (t6.run.resume: ckpt_path, or the newest whole checkpoint in the run's
    checkpoint folder), read (mapped, not loaded): a missing or damaged file, one whose model this config does not
    build, or one trained with another tokenizer than the run's, fails here naming both."""
    found = find_resume(cfg.get("ckpt_path"), bool(cfg.get("auto_resume", False)), folder)
    if found.path is None:
        return None
    ckpt = found.ckpt
    if ckpt.get("format") in (WARM_START_FORMAT, HF_FORMAT):
        kind = "a Hugging Face directory" if ckpt["format"] == HF_FORMAT else "a converted (warm-start) checkpoint"
        raise SettingError(f"ckpt_path={found.path!r} is {kind}: start from it with init_from=")
    if tokenizer is not None and checkpoint_tokenizer(ckpt) != tokenizer:
        raise SettingError(mismatch(f"ckpt_path={found.path}", checkpoint_tokenizer(ckpt), "this run", tokenizer))
    check_resume_model(found.path, ckpt, mcfg)
    return Resume(found.path, int(ckpt.get("global_step", 0)), ckpt.get("mlflow_run_id"), found.how, found.passed_over)


def check_resume_model(path: str, ckpt: dict, mcfg: ModelConfig) -> None:
    """The checkpoint's model (its config, and every tensor of it: none missing or mis-shaped) is the one this run's
    config builds; else an error naming both and the settings that differ."""
    saved, _ = model_state(ckpt, "ckpt_path", path)  # its tensors against its own config
    if saved == mcfg:
        return
    ours, theirs = asdict(mcfg), asdict(saved)
    differ = [
        f"{name}: {theirs[name]!r} in the checkpoint, {ours[name]!r} here"
        for name in ours
        if ours[name] != theirs[name]
    ]
    raise SettingError(
        f"ckpt_path={path!r} holds a {saved.attention} model (d_model={saved.d_model}, n_layer={saved.n_layer}, "
        f"n_head={saved.n_head}) that this run's config does not build ({mcfg.attention}): "
        + "; ".join(differ)
        + f". Resume it with the settings it was trained with (attention={saved.attention} and its size.*), or "
        "start a new run (ckpt_path=null, auto_resume=false or another hydra.run.dir)"
    )


def plan_warm_start(cfg: DictConfig) -> WarmStart | None:
    """init_from: a converted checkpoint or a Hugging Face directory, checked; its model shape is the run's."""
    if not cfg.get("init_from"):
        return None
    from t6.model.config import ModelConfig
    from t6.uptrain.convert import load_warm_start

    init = load_warm_start(cfg.init_from)
    changes = tuple(recipe.model_changes(cfg, init["model_config"]))
    conv = init.get("conversion")  # a converted checkpoint's; a Hugging Face directory has none
    how = "a Hugging Face directory or pretrained model"
    if conv:
        distilled = f", distilled {conv['distill']['steps']} steps" if conv.get("distill") else ""
        heads = f" kv_heads={conv['kv_heads']}" if conv.get("kv_heads") else ""
        how = f"{conv['target']}{heads} {conv['method']}{distilled}"
    source = (init.get("source") or {}).get("mlflow_run_id") or ""
    return WarmStart(str(cfg.init_from), source, how, changes, ModelConfig(**init["model_config"]))


def plan_tokenizer(cfg: DictConfig) -> Tokenizer:
    """The run's tokenizer (t6.data.tokenizer.run_tokenizer: tokenizer=null is init_from's own, else GPT-2), which
    execute hands to the data, the evaluation, the samples and the checkpoints. A warm start or a teacher of
    another tokenizer than the one set is an error naming both."""
    setting, init_from = cfg.get("tokenizer"), cfg.get("init_from")
    tokenizer = run_tokenizer(setting, init_from)
    for what, path in ((f"init_from={init_from}", init_from), (f"teacher={cfg.get('teacher')}", cfg.get("teacher"))):
        if path and load_tokenizer(path) != tokenizer:
            raise SettingError(mismatch(what, load_tokenizer(path), f"this run (tokenizer={setting})", tokenizer))
    return tokenizer


def plan_tracking(sections: Sections, resume: Resume | None, warm: WarmStart | None) -> Tracking | None:
    """The MLflow store (reachable, and holding the run a resume continues), the run, its name and tags, and the
    sweep parent."""
    conf = sections.mlflow
    if conf is None:
        return None
    continues = resume.mlflow_run_id if resume is not None and conf.continue_run else None
    unreachable = None
    try:
        check_tracking_store(conf.tracking_uri, continues, resume.ckpt_path if resume else None)
    except StoreUnreachable as err:
        if not continues:
            raise  # a new run needs the server to create it
        unreachable = str(err.__cause__ or err)  # a resume continues its run in the outbox
    experiment, run_name, tags = conf.experiment_name, conf.run_name, dict(conf.tags)
    if warm is not None:
        tags.update(source_run_id=warm.source_run_id, init_from=warm.path, conversion=warm.conversion)
    sweep = sweep_job_info()
    if sweep is not None:  # a multirun job: a child run of the sweep's parent run
        experiment, run_name, job_tags = sweep_job_run(sweep)
        tags.update(job_tags)
    interval = conf.system_metrics_interval_s if conf.system_metrics else None
    run_id = conf.run_id or continues  # a resumed run logs into the same MLflow run
    logged = {}
    spool = Path(conf.outbox_dir) / "rank0.jsonl"
    if run_id and spool.exists():  # what the run has already: this run directory's spool holds all it wrote
        logged = logged_steps(spool, run_id)
    elif run_id and not unreachable:  # a checkpoint of another directory: the store says
        logged = stored_steps(conf.tracking_uri, run_id)
    return Tracking(
        conf.tracking_uri,
        experiment,
        run_name,
        run_id,
        sweep["parent_run_id"] if sweep else None,
        interval,
        log_model_choice(conf.log_model),
        conf.outbox_dir,
        unreachable,
        tags,
        logged,
        float(conf.flush_timeout_s),
    )


def instantiate_data(cfg: DictConfig, tokenizer: Tokenizer | None = None):
    """The datamodule object (cheap: it opens nothing until `check`, `prepare_data` or `setup`)."""
    from hydra.utils import instantiate

    return instantiate(cfg.data, tokenizer=tokenizer) if tokenizer is not None else instantiate(cfg.data)


def plan_training(
    cfg: DictConfig, sections: Sections, hardware: Hardware, parallel: Parallel, batch: BatchPlan
) -> Training:
    """The seed, what a non-finite loss does, the loss's implementation on this device (loss_impl=auto: Liger's
    kernel on CUDA; liger where Triton cannot run is an error), validation counted in micro-batches, and the
    optimizer's own arguments for this device and strategy."""
    every = sections.trainer.val_check_interval
    return Training(
        int(cfg.seed),
        cfg.get("nonfinite_loss", "stop"),
        "liger" if use_liger(cfg.get("loss_impl", "auto"), hardware.device) else "chunked",
        cfg.get("loss_chunk_tokens"),
        int(sections.trainer.max_steps),
        every * batch.accumulation if isinstance(every, int) else every,  # Lightning counts micro-batches
        plan_optimizer(cfg, hardware, parallel),
        bool(cfg.get("gradient_checkpointing", False)),
        cfg.get("teacher") or None,
        float(cfg.get("teacher_kl_weight", 0.5)),
    )


def plan_optimizer(cfg: DictConfig, hardware: Hardware, parallel: Parallel) -> dict:
    """AdamW on CUDA runs as one fused kernel over all parameters (unless optimizer.fused says otherwise);
    Muon and Adafactor need whole 2-D matrices, which FSDP shards: an error naming both settings."""
    import torch
    from hydra.utils import get_object

    from t6.training.optim import MuonWithAdamW

    target = get_object(cfg.optimizer._target_)
    if parallel.strategy is Strategy.FSDP and issubclass(target, (MuonWithAdamW, torch.optim.Adafactor)):
        raise ConfigError(
            "Optimizer and strategy",
            [
                f"optimizer={target.__name__} needs whole 2-D weight matrices (orthogonalized or factored), but "
                "trainer=fsdp shards them; use optimizer=adamw with trainer=fsdp, or trainer=ddp"
            ],
        )
    if issubclass(target, torch.optim.AdamW) and hardware.device == "cuda" and "fused" not in cfg.optimizer:
        return {"fused": True}
    return {}


def plan_batch(
    cfg: DictConfig, sections: Sections, mcfg: ModelConfig, hardware: Hardware, parallel: Parallel
) -> BatchPlan:
    """The micro-batch (data.batch_size=auto: the largest that fits; a number: checked) and its accumulation."""
    from t6.data.batching import accumulation_steps

    world = parallel.world_size
    data = cfg.data
    requested, global_batch, seq_len = data.batch_size, data.get("global_batch_size"), int(data.seq_len)
    per_device = sequences_per_device(requested, global_batch, world)
    if requested != "auto":
        accumulation_steps(requested, global_batch, world)  # raises when it does not divide
    plan = preflight(cfg, mcfg, hardware, parallel, requested, per_device)
    micro = plan.batch if plan is not None else int(requested)
    return BatchPlan(
        seq_len,
        micro,
        accumulation_steps(micro, global_batch, world),
        sequences_per_step(micro, global_batch, world),
        world,
        plan,
    )


def preflight(cfg, mcfg, hardware: Hardware, parallel: Parallel, requested, per_device: int):
    """The memory preflight: the micro-batch (auto or checked) against the memory this process may use."""
    device = hardware.device
    if not cfg.get("preflight", True) or device not in ("cpu", "cuda"):
        if requested == "auto":
            raise SettingError(
                f"data.batch_size=auto needs the memory preflight (preflight=true, a cpu or cuda device; "
                f"here preflight={cfg.get('preflight', True)}, device {device}); give data.batch_size a number"
            )
        return None
    if device == "cuda":
        available, source = probes.available_memory("cuda", parallel.device_index)
        runtime = 0
    else:
        available, source = probes.available_memory("cpu")
        if parallel.devices > 1:
            available, source = available // parallel.devices, f"{source} shared by {parallel.devices} processes"
        runtime = probes.process_rss()  # the process as it stands (no model is built yet)
    ways_out = (
        "a smaller data.batch_size (or data.batch_size=auto with data.global_batch_size), gradient_checkpointing=true, "
        "trainer=fsdp with trainer.strategy.activation_checkpointing=true, trainer=fsdp over more devices "
        "(trainer.devices), or a smaller size"
    )

    def estimate(batch: int) -> memory.StepMemory:
        return memory.estimate_step_memory(
            mcfg,
            batch,
            int(cfg.data.seq_len),
            precision=hardware.precision,
            optimizer_target=cfg.optimizer._target_,
            shards=parallel.shards,
            activation_checkpointing=parallel.activation_checkpointing or bool(cfg.get("gradient_checkpointing")),
            device=device,
            runtime=runtime,
            loss_chunk_tokens=cfg.get("loss_chunk_tokens"),
            liger=use_liger(cfg.get("loss_impl", "auto"), device),
            ddp_buckets=parallel.ddp_buckets,
        )

    return memory.fit_micro_batch(estimate, requested, per_device, available, source, ways_out)


# The share of the device's peak a training step is assumed to reach when the plan estimates its time.
ASSUMED_MFU = 0.4


def checkpoint_background(sections: Sections, hardware: Hardware, parallel: Parallel) -> bool:
    """Whether checkpoints are written by a thread from a host copy (the Trainer's BackgroundCheckpointIO is given
    this): as its `background` setting says, else (null) from a GPU, where the copy costs far less than the write; not
    under FSDP, which gathers the state into rank 0's host memory, written at once; not on the CPU, where the copy
    would take the memory the step was planned with and the cores that would write are the ones training."""
    from t6.training.checkpoint_io import BackgroundCheckpointIO

    io = next((p for p in sections.trainer.plugins if p.builds(BackgroundCheckpointIO)), None)
    if io is None:
        return False
    if io.arguments.get("background") is not None:
        return bool(io.arguments["background"])
    return hardware.device == "cuda" and parallel.strategy is not Strategy.FSDP


def plan_checkpoints(
    cfg: DictConfig, sections: Sections, mcfg: ModelConfig, hardware: Hardware, batch: BatchPlan, background: bool
) -> Checkpoints | None:
    """How often checkpoints are written, for callbacks.model_checkpoint.every_n_train_steps=auto from the
    checkpoint's size and an estimate of the step's time (its FLOPs at ASSUMED_MFU of the device's peak),
    t6.training.callbacks.checkpoint.checkpoint_interval; a checkpoint larger than the process may write (its
    file-size limit, `ulimit -f`) stops the run here. None: no checkpoint callback."""
    from t6.model.facts import flops_per_token, meta_model
    from t6.training.callbacks.checkpoint import checkpoint_interval
    from t6.training.checkpoint_io import file_size_limit

    component = sections.callback(RunCheckpoint)
    if component is None:
        return None
    model = meta_model(mcfg)
    optimizer, _ = memory.optimizer_state_bytes(model, cfg.optimizer._target_, 4)
    state = model.num_params() * hw_device.param_dtype(hardware.precision).itemsize + optimizer  # ~ a checkpoint file
    limit = file_size_limit()
    if limit is not None and state > limit:
        raise NoRoom(
            f"a checkpoint of this run holds ~{state / 2**20:,.0f} MiB (the weights and the optimizer's state), but "
            f"this process may write no file larger than {limit / 2**20:,.1f} MiB (its file-size limit, `ulimit -f`); "
            "raise the limit (ulimit -f unlimited) and start again"
        )
    every = component.arguments.get("every_n_train_steps")
    if every != "auto":
        return Checkpoints(every, f"callbacks.{component.name}.every_n_train_steps={every}", background)
    peak = hardware.peak_flops
    tokens = batch.micro_batch * batch.accumulation * batch.seq_len  # per device and optimizer step
    step_s = flops_per_token(model, batch.seq_len) * tokens / (peak * ASSUMED_MFU)
    every, why = checkpoint_interval(state, step_s, background, int(sections.trainer.max_steps))
    return Checkpoints(every, why, background)
