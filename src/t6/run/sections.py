"""The config groups a run hands to Lightning and MLflow, read once into small typed values: `read_sections(cfg)`.

    sections, problems = read_sections(cfg)
    sections.trainer      TrainerSettings: the lightning.Trainer settings (the ones the plan decides by name)
    sections.callbacks    the callbacks group, one Component per `_target_` entry, found by class, not by key
    sections.mlflow       MLflowSettings (logger.mlflow), or None (logger=none)
    sections.loggers      the logger group's other `_target_` entries (a CSV logger), as Components
    sections.schedule     ScheduleSettings (lr_ablation): the peak, floor and warmup, and the scheduler's Component

As a mechanism's Options do for its options, each value says what is wrong with it (`problems`), naming the field
and the fix; the checks (t6.run.checks) and the plan (t6.run.plan) read these values, and nothing else reads those
groups of the config.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from t6.tracking.mlflow import log_model_choice


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Component:
    """A `_target_` entry of the config: what it builds (a class or a function, by its import path) and with what
    (its other keys, resolved). `name` is its key in the group, for messages only."""

    name: str
    target: str
    arguments: dict = field(default_factory=dict)

    @classmethod
    def read(cls, name: str, node: DictConfig) -> Component:
        arguments = OmegaConf.to_container(node, resolve=True)
        return cls(str(name), str(arguments.pop("_target_")), arguments)

    def kind(self) -> Any:
        """The class or function it names (imported)."""
        from hydra.utils import get_object

        return get_object(self.target)

    def builds(self, cls: type) -> bool:
        kind = self.kind()
        return inspect.isclass(kind) and issubclass(kind, cls)

    def with_arguments(self, **arguments) -> Component:
        return Component(self.name, self.target, {**self.arguments, **arguments})

    def build(self, **arguments) -> Any:
        """The object, with these arguments beside the config's (Hydra's instantiate: `_partial_` and nested
        `_target_` entries as in the config files)."""
        from hydra.utils import instantiate

        return instantiate({"_target_": self.target, **self.arguments, **arguments})


def components(group: DictConfig | None) -> tuple[Component, ...]:
    """Every `_target_` entry of a dict-of-configs group (callbacks, loggers); others (a recipe's bare override of
    a removed entry, null) build nothing."""
    if not group:
        return ()
    return tuple(Component.read(k, v) for k, v in group.items() if isinstance(v, DictConfig) and "_target_" in v)


# ------------------------------------------------------------------------------------ trainer


PLANNED = ("accelerator", "devices", "num_nodes", "strategy", "precision", "plugins", "callbacks", "logger")


@dataclass(frozen=True)
class TrainerSettings:
    """The `trainer` group. The plan decides the device, processes, strategy and precision from the first five;
    `others` are the lightning.Trainer settings passed as given (default_root_dir, limit_val_batches, ...)."""

    accelerator: str
    devices: Any  # a count, a list of device ids, or auto / -1
    num_nodes: int
    strategy: str | Component | None  # a Lightning strategy name, or a `_target_` node
    precision: str
    max_steps: Any
    val_check_interval: Any
    log_every_n_steps: Any
    gradient_clip_val: Any
    plugins: tuple[Component, ...]
    others: dict

    @classmethod
    def read(cls, node: DictConfig) -> TrainerSettings:
        strategy = node.get("strategy")
        given = OmegaConf.to_container(node, resolve=True)
        named = ("max_steps", "val_check_interval", "log_every_n_steps", "gradient_clip_val")
        return cls(
            str(node.get("accelerator", "auto")),
            given.get("devices", 1),
            int(node.get("num_nodes", 1) or 1),
            Component.read("strategy", strategy) if isinstance(strategy, DictConfig) else strategy,
            str(node.get("precision", "auto")),
            *(given.get(key, default) for key, default in zip(named, (None, None, 50, None))),
            tuple(
                Component.read(f"plugins[{i}]", p)
                for i, p in enumerate(node.get("plugins") or [])
                if isinstance(p, DictConfig) and "_target_" in p
            ),  # fmt: skip
            {k: v for k, v in given.items() if k not in (*PLANNED, *named, "_target_")},
        )

    def strategy_option(self, name: str, default=None):
        """An argument of a `_target_` strategy (e.g. FSDP's activation_checkpointing)."""
        return self.strategy.arguments.get(name, default) if isinstance(self.strategy, Component) else default

    def problems(self, keys: list[str]) -> list[str]:
        """Its numbers' signs and ranges, the checkpoint format FSDP writes, and every key (`keys`: the group's, as
        given) a setting of lightning.Trainer, a misspelled one named with the nearest."""
        import lightning

        problems = []

        def need(ok: bool, key: str, value, what: str) -> None:
            if not ok:
                problems.append(f"trainer.{key}={value!r} must be {what}")

        need(
            is_int(self.max_steps) and self.max_steps >= 1,
            "max_steps",
            self.max_steps,
            "a positive number of optimizer steps (-1 would train without end, 0 would train nothing), "
            "e.g. trainer.max_steps=1000",
        )
        every = self.val_check_interval
        need(
            every is None or (is_int(every) and every >= 1) or (isinstance(every, float) and 0 < every <= 1),
            "val_check_interval",
            every,
            "a positive number of optimizer steps between validations (or a fraction in (0, 1])",
        )
        log_every = self.log_every_n_steps
        need(is_int(log_every) and log_every >= 1, "log_every_n_steps", log_every, "a positive number of steps")
        clip = self.gradient_clip_val
        need(clip is None or (is_number(clip) and clip >= 0), "gradient_clip_val", clip, ">= 0 or null")
        kind = self.strategy_option("state_dict_type", "full")
        if kind != "full":  # FSDP's sharded checkpoints: a directory of shards, written in place by every rank
            problems.append(
                f"trainer.strategy.state_dict_type={kind}: T6 Lab checkpoints are single files (resume, "
                "ckpt_path=last, auto_resume, the MLflow model upload, eval.py and generate.py read one file, replaced "
                "atomically); "
                "use trainer.strategy.state_dict_type=full (rank 0 gathers the model and optimizer into one file)"
            )
        known = sorted(set(inspect.signature(lightning.Trainer.__init__).parameters) - {"self"})
        for key in keys:
            if key == "_target_" or key in known:
                continue
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean trainer.{close[0]}?" if close else f"; lightning.Trainer takes {', '.join(known)}"
            problems.append(f"trainer.{key} is not a setting of lightning.Trainer{hint}")
        return problems


# ------------------------------------------------------------------------------------ logger: MLflow


@dataclass(frozen=True)
class MLflowSettings:
    """`logger.mlflow` (conf/logger/mlflow.yaml says what each is)."""

    target: str
    experiment_name: str
    run_name: str
    tracking_uri: str
    outbox_dir: str
    artifact_dir: str | None = None
    log_model: Any = "final"
    run_id: str | None = None
    continue_run: bool = True
    system_metrics: bool = True
    system_metrics_interval_s: Any = 10
    flush_timeout_s: Any = 30
    tags: dict = field(default_factory=dict)

    @classmethod
    def read(cls, logger: DictConfig | None) -> MLflowSettings | None:
        """The MLflow logger's settings when one is configured. A recipe may set `logger.mlflow.<key>` for its runs;
        under `logger=none` that leaves a bare dict without `_target_`, which is no logger."""
        node = (logger or {}).get("mlflow")
        if not isinstance(node, DictConfig) or "_target_" not in node:
            return None
        given = OmegaConf.to_container(node, resolve=True)
        given["tags"] = {str(k): str(v) for k, v in (given.get("tags") or {}).items()}
        return cls(target=given.pop("_target_"), **given)

    def problems(self) -> list[str]:
        problems = []
        try:
            log_model_choice(self.log_model)
        except ValueError as err:
            problems.append(str(err))
        flush, interval = self.flush_timeout_s, self.system_metrics_interval_s
        if not (is_number(flush) and flush >= 0):
            problems.append(f"logger.mlflow.flush_timeout_s={flush!r} must be a number of seconds >= 0")
        if not (is_number(interval) and interval > 0):
            problems.append(
                f"logger.mlflow.system_metrics_interval_s={interval!r} must be a positive number of seconds"
            )
        return problems


# ------------------------------------------------------------------------------------ lr_ablation


@dataclass(frozen=True)
class ScheduleSettings:
    """`lr_ablation`: the learning rate's peak and floor, the warmup, and the scheduler that follows them (None: a
    constant learning rate)."""

    name: str
    max_lr: Any
    min_lr: Any
    warmup_steps: Any
    scheduler: Component | None

    @classmethod
    def read(cls, node: DictConfig) -> ScheduleSettings:
        scheduler = node.get("scheduler")
        return cls(
            str(node.get("name", "")),
            node.get("max_lr"),
            node.get("min_lr"),
            node.get("warmup_steps"),
            Component.read("scheduler", scheduler) if isinstance(scheduler, DictConfig) else None,
        )

    def problems(self) -> list[str]:
        problems = []
        if self.max_lr is not None and not (is_number(self.max_lr) and self.max_lr > 0):
            problems.append(f"lr_ablation.max_lr={self.max_lr!r} must be a positive learning rate")
        if self.min_lr is not None:
            top = self.max_lr if is_number(self.max_lr) else float("inf")
            if not (is_number(self.min_lr) and 0 <= self.min_lr <= top):
                problems.append(
                    f"lr_ablation.min_lr={self.min_lr!r} must be between 0 and lr_ablation.max_lr={self.max_lr}"
                )
        if self.warmup_steps is not None and not (is_int(self.warmup_steps) and self.warmup_steps >= 0):
            problems.append(f"lr_ablation.warmup_steps={self.warmup_steps!r} must be a number of steps >= 0")
        return problems


# ------------------------------------------------------------------------------------ all of them


@dataclass(frozen=True)
class Sections:
    trainer: TrainerSettings
    callbacks: tuple[Component, ...]
    mlflow: MLflowSettings | None
    loggers: tuple[Component, ...]  # the logger group's entries other than MLflow's
    schedule: ScheduleSettings

    def callback(self, cls: type) -> Component | None:
        """The configured callback that builds `cls` (or a subclass of it), whatever its key."""
        return next((c for c in self.callbacks if c.builds(cls)), None)


def read_sections(cfg: DictConfig) -> tuple[Sections, list[str]]:
    """(the sections of cfg, their problems: every one, each naming its field and the fix)."""
    mlflow = MLflowSettings.read(cfg.get("logger"))
    loggers = tuple(c for c in components(cfg.get("logger")) if mlflow is None or c.name != "mlflow")
    sections = Sections(
        TrainerSettings.read(cfg.trainer),
        components(cfg.get("callbacks")),
        mlflow,
        loggers,
        ScheduleSettings.read(cfg.lr_ablation),
    )
    problems = sections.trainer.problems([str(k) for k in cfg.trainer])
    problems += sections.schedule.problems()
    problems += mlflow.problems() if mlflow is not None else []
    return sections, problems
