"""Downstream evaluation during training, configured by the `eval` group.

`check_eval_tasks(EvalSettings.read(cfg.eval))` runs in the run's plan: it checks every task name and loads every
dataset, so a typo or a machine without the datasets fails in seconds rather than after hours of
training. `build_eval_callback(settings)` writes the embedded tasks and builds the callback, which
evaluates every `every_n_steps` optimizer steps and/or at the end of training.

Under DDP and FSDP every rank evaluates a whole, unwrapped T6 (the DDP replica itself; under FSDP
a copy gathered from the shards, on every rank, freed afterwards) and scores its share of the
requests through lm-eval's rank / world-size protocol (t6.evaluation.parallel); rank 0 gathers
the metrics and logs them. The evaluation touches neither the gradients nor the wrappers, so no
training collective is left half done, and no rank idles through another's whole evaluation.
It runs under the training precision's autocast, in eval mode under torch.no_grad(); the train/eval
flags and the global RNG states are restored afterwards, so training continues exactly as it
would have without it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.loggers import MLFlowLogger
from omegaconf import DictConfig, OmegaConf
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from t6.errors import SettingError
from t6.evaluation.runner import EvalSpec, log_results, resolve_tasks, run_harness, spec_from_config
from t6.model import T6
from t6.training.fsdp import full_model

log = logging.getLogger(__name__)


class DownstreamEval(L.Callback):
    def __init__(
        self, spec: EvalSpec, task_manager, every_n_steps: int | None = None, at_end: bool = True, tokenizer=None
    ):
        """tokenizer: the run's (t6.data.tokenizer.Tokenizer; None: GPT-2)."""
        if every_n_steps is not None and every_n_steps <= 0:
            raise SettingError(f"eval.every_n_steps={every_n_steps} must be a positive number of steps or null")
        self.spec, self.task_manager = spec, task_manager
        self.every_n_steps, self.at_end = every_n_steps, at_end
        self.tokenizer = tokenizer
        self.last_step: int | None = None
        self.history: list[tuple[int, dict[str, float]]] = []  # (step, metrics) of every evaluation
        self.seconds: list[float] = []  # how long each evaluation took (rank 0), also logged as perf/eval_s

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        step = trainer.global_step
        if self.every_n_steps and step and step % self.every_n_steps == 0 and step != self.last_step:
            self.evaluate(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at_end and trainer.global_step != self.last_step:
            self.evaluate(trainer, pl_module)

    def evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        step = self.last_step = trainer.global_step
        start = time.perf_counter()
        wrapped = trainer.strategy.model
        model = full_model(wrapped, lambda: T6(pl_module.model.cfg)) if isinstance(wrapped, FSDP) else pl_module.model
        with trainer.precision_plugin.forward_context():
            results = run_harness(
                model, self.spec, self.task_manager, data_parallel=trainer.world_size > 1, tokenizer=self.tokenizer
            )
        del model
        if trainer.is_global_zero:
            evaluated = time.perf_counter()
            self.seconds.append(evaluated - start)
            for logger in trainer.loggers:
                logger.log_metrics({"perf/eval_s": evaluated - start}, step=step)
            metrics = self.log_to_loggers(trainer, results, step)
            self.history.append((step, metrics))
            shown = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k.endswith("/avg"))
            logged = time.perf_counter() - evaluated
            log.info(
                "downstream evaluation at step %d in %.1f s (logging %.2f s): %s",
                step,
                evaluated - start,
                logged,
                shown,
            )

    def log_to_loggers(self, trainer: L.Trainer, results: dict, step: int) -> dict[str, float]:
        from t6.evaluation.runner import flat_metrics

        mlflow = next((lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)), None)
        if mlflow is not None:
            run_name = mlflow.experiment.get_run(mlflow.run_id).info.run_name
            return log_results(mlflow.experiment, mlflow.run_id, results, self.spec, step, run_name)
        metrics = flat_metrics(results, self.spec)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        return metrics


@dataclass(frozen=True)
class EvalSettings:
    """The `eval` group (conf/eval/*.yaml), read once: what to evaluate (`spec`; the directories of the tasks built
    from the shipped text join its include path when `build_eval_callback` writes them), those tasks' builders (name
    -> the builder's node, for the tasks listed), and when to evaluate."""

    spec: EvalSpec
    local_tasks: dict = field(default_factory=dict)
    every_n_steps: int | None = None
    at_end: bool = True

    @classmethod
    def read(cls, eval_cfg: DictConfig | dict | None) -> EvalSettings | None:
        """None for `eval=none`."""
        if not eval_cfg:
            return None
        cfg = OmegaConf.to_container(eval_cfg, resolve=True) if isinstance(eval_cfg, DictConfig) else dict(eval_cfg)
        local = {k: v for k, v in (cfg.get("local_tasks") or {}).items() if k in (cfg.get("tasks") or [])}
        return cls(spec_from_config(cfg), local, cfg.get("every_n_steps"), bool(cfg.get("at_end", True)))


def check_eval_tasks(settings: EvalSettings | None) -> None:
    """Before training, reading only: every task of the `eval` group that is not built from the shipped
    text (eval.local_tasks) exists, and its dataset loads."""
    if settings is None:
        return
    others = [t for t in settings.spec.tasks if t not in settings.local_tasks]
    if others:
        resolve_tasks(replace(settings.spec, tasks=others))


def build_eval_callback(settings: EvalSettings | None, tokenizer=None) -> DownstreamEval | None:
    """The callback of the `eval` group, with its local tasks written and every task checked, evaluating in
    `tokenizer` (the run's; None: GPT-2); None for `eval=none`."""
    if settings is None:
        return None
    include = [instantiate(builder) for builder in settings.local_tasks.values()]  # each writes its YAML + JSONL
    spec = replace(settings.spec, include_path=[*settings.spec.include_path, *map(str, include)])
    tm = resolve_tasks(spec)
    return DownstreamEval(spec, tm, settings.every_n_steps, settings.at_end, tokenizer=tokenizer)
