"""The problems of a training config itself, every one at once, each naming the field and the fix.

`config_problems(cfg, sections, tokenizer)` runs every check that needs nothing but the config and the run's
tokenizer (no data, checkpoint, store or device): the model and its vocabulary against the tokenizer, the learning
rate, the batch and sequence settings, the samples, the loss, the evaluation and the directories the run writes. The
typed sections check their own settings (t6.run.sections: the Trainer's, the schedule's, MLflow's).
`t6.run.plan.plan_run` raises every problem of both together as one ConfigError.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig

from t6.data.batching import batch_problems
from t6.data.tokenizer import Tokenizer, gpt2
from t6.errors import ConfigError
from t6.hydra_config import model_config
from t6.model.config import ModelConfig
from t6.model.loss import IMPLS
from t6.run.samples import check_samples
from t6.run.sections import Sections, is_int, is_number
from t6.training.callbacks import RunCheckpoint

NONFINITE = ("stop", "skip")


def config_problems(
    cfg: DictConfig, sections: Sections, tokenizer: Tokenizer | None = None
) -> tuple[ModelConfig | None, list[str]]:
    """(the model config, or None when it has problems; every problem of the config besides the sections' own).
    tokenizer: the run's (t6.run.plan.plan_tokenizer; None: GPT-2 BPE), whose ids the model's vocabulary must hold."""
    problems: list[str] = []
    mcfg = None
    try:
        mcfg = model_config(cfg)
    except ConfigError as err:
        problems += err.problems
    problems += vocabulary_problems(cfg, tokenizer)
    problems += number_problems(cfg)
    problems += learning_rate_problems(cfg, sections)
    problems += dataset_problems(cfg)
    problems += data_problems(cfg)
    problems += raised(check_samples, cfg)
    problems += training_problems(cfg, sections)
    problems += eval_problems(cfg.get("eval"))
    problems += directory_problems(cfg, sections)
    return (mcfg if not problems else None), problems


def raised(check: Callable, *args) -> list[str]:
    """A check that raises ValueError on its first problem, as a list of problems."""
    try:
        check(*args)
    except ValueError as err:
        return [str(err)]
    return []


def vocabulary_problems(cfg: DictConfig, tokenizer: Tokenizer | None = None) -> list[str]:
    """The model's embedding holds every token id the tokenizer (None: GPT-2 BPE) makes (else an index error at the
    first step)."""
    vocab = cfg.size.get("vocab_size")
    tokenizer = tokenizer or gpt2()
    tokens = tokenizer.n_vocab
    if is_int(vocab) and vocab < tokens:
        return [
            f"size.vocab_size={vocab} is smaller than the tokenizer's {tokens:,} tokens ({tokenizer.name}): its ids "
            f"up to {tokens - 1} would index past the embedding; set size.vocab_size>={tokens} (e.g. "
            f"size.vocab_size={-(-tokens // 64) * 64}, a multiple of 64)"
        ]
    return []


def number_problems(cfg: DictConfig) -> list[str]:
    """The numbers of the groups the sections do not hold, each named by its field with a value that works."""
    problems = []

    def need(ok: bool, field: str, value, what: str) -> None:
        if not ok:
            problems.append(f"{field}={value!r} must be {what}")

    decay = cfg.optimizer.get("weight_decay", 0.0)
    need(is_number(decay) and decay >= 0, "optimizer.weight_decay", decay, ">= 0")
    windows = cfg.data.get("val_windows")
    need(windows is None or (is_int(windows) and windows >= 1), "data.val_windows", windows, "positive or null (all)")
    chunk = cfg.get("loss_chunk_tokens")
    need(chunk is None or (is_int(chunk) and chunk >= 1), "loss_chunk_tokens", chunk, "a positive number or null")
    need(is_int(cfg.get("seed")), "seed", cfg.get("seed"), "an integer")
    return problems


def directory_problems(cfg: DictConfig, sections: Sections) -> list[str]:
    """The directories the run writes (its run directory, checkpoints, outbox) can be written, or made where an
    existing directory above them can be written."""
    from t6.run.resume import checkpoint_dir

    wanted = {"paths.output_dir": cfg.paths.output_dir}
    checkpoints = sections.callback(RunCheckpoint)
    if checkpoints is not None:
        wanted[f"callbacks.{checkpoints.name}.dirpath"] = checkpoint_dir(cfg.paths.output_dir, checkpoints)
    if sections.mlflow is not None and sections.mlflow.outbox_dir:
        wanted["logger.mlflow.outbox_dir"] = sections.mlflow.outbox_dir
    problems = []
    for field, path in wanted.items():
        why = unwritable(Path(str(path)))
        if why:
            problems.append(f"{field}={path}: {why}; give a directory this run may write (or run where it may)")
    return problems


def unwritable(path: Path) -> str | None:
    """Why `path` cannot be written or made (None: it can), from the nearest directory that exists."""
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable" + (" (a read-only file system?)" if existing != path else "")
    return None


def learning_rate_problems(cfg: DictConfig, sections: Sections) -> list[str]:
    """One source for the peak learning rate: lr_ablation.max_lr. The schedule multiplies the optimizer's
    lr by lr(step) / max_lr, so an optimizer.lr that differs would silently scale the whole schedule."""
    lr, max_lr = cfg.optimizer.get("lr"), sections.schedule.max_lr
    if not (is_number(lr) and lr > 0):
        return [] if lr is None or lr == max_lr else [f"optimizer.lr={lr!r} must be a positive learning rate"]
    if sections.schedule.scheduler and max_lr is not None and float(lr) != float(max_lr):
        return [
            f"optimizer.lr={lr} differs from lr_ablation.max_lr={max_lr}, the schedule's peak; set the peak with "
            f"lr_ablation.max_lr={lr} (and lr_ablation.min_lr), and leave optimizer.lr to follow it"
        ]
    return []


def dataset_problems(cfg: DictConfig) -> list[str]:
    """`dataset=` is listed by --help (a group of conf/) but belongs to prepare.py."""
    if cfg.get("dataset") is not None:
        return [
            "dataset= chooses what prepare.py tokenizes; prepare it (python prepare.py dataset=local "
            "dataset.data_files=FILE.jsonl), then train on the shards with data=local (or data=fineweb_edu)"
        ]
    return []


def data_problems(cfg: DictConfig) -> list[str]:
    """Batch settings and sequence length, named by their fields, before any data is read."""
    data = cfg.data
    problems = batch_problems(data.get("batch_size"), data.get("global_batch_size"), data.get("seq_len"))
    seq_len, block = data.get("seq_len"), cfg.size.get("block_size")
    if isinstance(seq_len, int) and isinstance(block, int) and seq_len > block:
        problems.append(
            f"data.seq_len={seq_len} is longer than size.block_size={block}, the longest context the model is built "
            f"for (its positions and caches); set data.seq_len<={block} or size.block_size={seq_len}"
        )
    return problems


def training_problems(cfg: DictConfig, sections: Sections) -> list[str]:
    problems = []
    impl = cfg.get("loss_impl", "auto")
    if impl not in IMPLS:
        problems.append(f"loss_impl={impl!r} must be one of {', '.join(IMPLS)}")
    if cfg.get("nonfinite_loss", "stop") not in NONFINITE:
        problems.append(f"nonfinite_loss={cfg.get('nonfinite_loss')!r} must be 'stop' or 'skip'")
    if not isinstance(cfg.get("compile", "auto"), bool) and cfg.get("compile", "auto") != "auto":
        problems.append(f"compile={cfg.get('compile')!r} must be auto (on CUDA, off on the CPU), true or false")
    if not isinstance(cfg.get("gradient_checkpointing", False), bool):
        problems.append(f"gradient_checkpointing={cfg.get('gradient_checkpointing')!r} must be true or false")
    elif cfg.get("gradient_checkpointing") and sections.trainer.strategy_option("activation_checkpointing"):
        problems.append(
            "gradient_checkpointing=true and trainer.strategy.activation_checkpointing=true both recompute the "
            "blocks in backward; keep one"
        )
    checkpoints = sections.callback(RunCheckpoint)
    every = checkpoints.arguments.get("every_n_train_steps") if checkpoints is not None else None
    if every is not None and every != "auto" and (not is_int(every) or every < 0):
        problems.append(
            f"callbacks.{checkpoints.name}.every_n_train_steps={every!r} must be auto (from the run's length and "
            "the checkpoint's size), a number of steps (0: only last.ckpt, at the end) or null (after every validation)"
        )
    return problems


def eval_problems(eval_cfg: DictConfig | None) -> list[str]:
    """The `eval` group's own settings (its tasks are resolved by the plan, t6.evaluation.callback)."""
    if not eval_cfg:
        return []
    problems = []
    if not eval_cfg.get("tasks"):
        problems.append("eval.tasks is empty; list lm-eval task names or choose eval=none")
    shots = list(eval_cfg.get("num_fewshot") or [])
    if any(not isinstance(n, int) or n < 0 for n in shots):
        problems.append(f"eval.num_fewshot={shots} must hold numbers of examples >= 0")
    batch = eval_cfg.get("batch_size", "auto")
    if batch != "auto" and (not isinstance(batch, int) or isinstance(batch, bool) or batch <= 0):
        problems.append(f"eval.batch_size={batch!r} must be a positive number of rows or auto (from the memory left)")
    every = eval_cfg.get("every_n_steps")
    if every is not None and (not isinstance(every, int) or every <= 0):
        problems.append(f"eval.every_n_steps={every} must be a positive number of steps or null")
    return problems
