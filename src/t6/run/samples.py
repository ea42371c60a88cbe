"""Greedy samples after training: checked before the run, generated on rank 0 at its end, and logged
to the MLflow run as `samples.txt` (the closing summary prints the first)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import lightning as L
import torch
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.strategies import FSDPStrategy
from omegaconf import DictConfig, OmegaConf

from t6.data.tokenizer import Tokenizer, gpt2, run_tokenizer
from t6.errors import SettingError
from t6.inference.generate import generate_text

log = logging.getLogger(__name__)

SAMPLES_ARTIFACT = "samples.txt"


@dataclass(frozen=True)
class Samples:
    """The `samples` setting, read once: the prompts continued greedily after training, and how far."""

    prompts: tuple[str, ...]
    max_new_tokens: int

    @classmethod
    def read(cls, cfg: DictConfig) -> Samples | None:
        """None for samples=null (after check_samples)."""
        samples = cfg.get("samples")
        return None if samples is None else cls(tuple(samples.prompts), int(samples.max_new_tokens))


def check_samples(cfg: DictConfig) -> None:
    """samples.prompts (non-empty strings) and samples.max_new_tokens fit the model's context, before training."""
    samples = cfg.get("samples")
    if samples is None:
        return
    prompts, new = samples.get("prompts"), samples.get("max_new_tokens")
    if not OmegaConf.is_list(prompts) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise SettingError(
            f"samples.prompts={prompts} must be a non-empty list of non-empty strings "
            "(e.g. samples.prompts='[ROMEO:]'), or samples=null for no samples"
        )
    if not isinstance(new, int) or isinstance(new, bool) or new < 1:
        raise SettingError(f"samples.max_new_tokens={new} must be a positive integer")
    enc = run_tokenizer(cfg.get("tokenizer"), cfg.get("init_from"))  # the run's
    longest = max(len(enc.encode(p)) for p in prompts)
    if longest >= cfg.size.block_size:
        raise SettingError(
            f"samples: a prompt of {longest} tokens leaves no room in size.block_size={cfg.size.block_size}; "
            "shorten samples.prompts"
        )


def greedy_samples(model: torch.nn.Module, samples: Samples, tokenizer: Tokenizer | None = None) -> list[str]:
    """Each of samples.prompts continued greedily (temperature 0) by samples.max_new_tokens tokens at most
    (fewer where the prompt and they would pass the model's block size), in the run's tokenizer (default
    GPT-2). The prompts go in one left-padded batch, one generation for all (the decoder generation picks: a
    graph-replayed fixed-shape step on CUDA, t6.model.static_decode), where every attention honours padding
    and each prompt has room for all its tokens; otherwise one prompt at a time. A padded row computes what
    it would alone, so either way each text is the prompt's own greedy continuation."""
    was_training = model.training
    model.eval()
    enc, block, new = tokenizer or gpt2(), model.cfg.block_size, int(samples.max_new_tokens)
    prompts = list(samples.prompts)
    longest = max(len(enc.encode(p)) for p in prompts)
    batched = longest + new <= block and all(b.attn.supports_key_mask for b in model.blocks)
    try:
        if batched:
            return generate_text(model, prompts, new, 0.0, tokenizer=enc)
        return [generate_text(model, [p], min(new, block - len(enc.encode(p))), 0.0, tokenizer=enc)[0] for p in prompts]
    finally:
        model.train(was_training)


def samples_text(texts: list[str], step: int) -> str:
    """The samples.txt artifact: one block per prompt."""
    blocks = [f"=== sample {i + 1} (greedy, after step {step})\n{text}" for i, text in enumerate(texts)]
    return "\n\n".join(blocks) + "\n"


def log_samples(
    samples: Samples | None,
    trainer: L.Trainer,
    model: torch.nn.Module,
    mlflow: MLFlowLogger | None,
    tokenizer: Tokenizer | None = None,
) -> list[str]:
    """Rank 0, after training: the greedy samples in the run's tokenizer (default GPT-2), logged as samples.txt in
    the MLflow run (when there is one), and the seconds they took as `perf/samples_s` to the run's loggers."""
    if samples is None or not trainer.is_global_zero:
        return []
    if isinstance(trainer.strategy, FSDPStrategy):
        log.info(
            "samples: none under FSDP (each rank holds a shard of the weights); generate from the checkpoint "
            "with python generate.py ckpt_path=... temperature=0"
        )
        return []
    start = time.perf_counter()
    texts = greedy_samples(model, samples, tokenizer)
    seconds = time.perf_counter() - start
    for logger in trainer.loggers:
        logger.log_metrics({"perf/samples_s": seconds}, step=trainer.global_step)
        logger.save()
    if mlflow is not None:
        mlflow.experiment.log_text(mlflow.run_id, samples_text(texts, trainer.global_step), SAMPLES_ARTIFACT)
    return texts
