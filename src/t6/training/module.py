"""The LightningModule: next-token cross-entropy over the T6 backbone."""

from __future__ import annotations

import logging
from collections.abc import Callable

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import MLFlowLogger
from torchmetrics import MeanMetric

from t6.errors import Diverged, SettingError
from t6.model import T6, ModelConfig
from t6.model.loss import IGNORE_INDEX
from t6.training.fsdp import clip_grad_norm
from t6.training.optim import param_groups, param_kinds
from t6.training.stop import any_rank

log = logging.getLogger(__name__)


class T6LitModule(L.LightningModule):
    def __init__(
        self,
        model_config: dict,
        optimizer: Callable | None = None,
        scheduler: Callable | None = None,
        compile: bool = False,
        run_config: dict | None = None,
        nonfinite_loss: str = "stop",
        loss_chunk_tokens: int | None = None,
        loss_impl: str = "auto",
        gradient_checkpointing: bool = False,
        tokenizer: dict | None = None,
        teacher: T6 | None = None,
        teacher_kl_weight: float = 0.5,
    ):
        """model_config: ModelConfig fields as a plain dict (checkpoints stay loadable with
        weights_only=True); optimizer / scheduler: partials from Hydra, bound in configure_optimizers;
        run_config: the resolved experiment config, stored in checkpoints for eval/generate;
        nonfinite_loss: when the gradient norm of an optimizer step is NaN or inf (a non-finite loss
        in any of its micro-batches, on any rank): "stop" (raise, keeping the last good checkpoint) or
        "skip" (that step makes no update on any rank; its batches, step count and learning-rate
        schedule still advance, so the data position stays a function of the step). The norm is
        global (all-reduced under DDP and FSDP), so every rank decides the same without a collective.
        compile: every transformer block compiled for training and validation (T6.compile_blocks: one graph
        shared by the blocks, the loss outside it; DDP's all-reduce and FSDP's all-gathers overlap the other
        blocks' work).
        loss_chunk_tokens: tokens per chunk of the LM head + cross-entropy (None: all logits at once);
        loss_impl: "auto" (Liger-Kernel's fused kernel on CUDA, t6.model.loss's chunks elsewhere), "chunked",
        "liger".
        gradient_checkpointing: every block recomputed in backward (T6.gradient_checkpointing).
        tokenizer: the run's tokenizer as plain data (t6.data.tokenizer.Tokenizer.spec), recorded in every
        checkpoint (`tokenizer`), so evaluation, generation and export read text as the model was trained.
        teacher: a model whose next-token distributions the training loss also follows (uptraining a converted
        model with its source as teacher): loss = (1 - w) cross-entropy + w KL(teacher || model) over the
        positions with a target, w = teacher_kl_weight; validation stays the cross-entropy alone. The teacher
        is frozen, kept out of the checkpoint and the optimizer."""
        super().__init__()
        if nonfinite_loss not in ("stop", "skip"):
            raise SettingError(f"nonfinite_loss={nonfinite_loss!r} must be 'stop' or 'skip'")
        self.nonfinite_loss = nonfinite_loss
        self.loss_chunk_tokens = loss_chunk_tokens
        self.loss_impl = loss_impl
        self.skipped_steps = 0
        self.save_hyperparameters("model_config", "compile", logger=False)
        self.model = T6(ModelConfig(**model_config))
        self.model.gradient_checkpointing = gradient_checkpointing
        self.param_kinds = param_kinds(self.model)  # before any wrapping shards the parameters into 1-D views
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.run_config = run_config
        self.tokenizer = tokenizer
        if teacher is not None:
            teacher.requires_grad_(False).eval()
        self.teacher = (teacher,) if teacher is not None else ()  # a tuple: not a submodule (no state, no grads)
        self.teacher_kl_weight = float(teacher_kl_weight)
        self.val_loss = MeanMetric()
        if compile:
            self.model.compile_blocks()  # checkpoints keep the plain `model.` parameter names

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)  # [B, T, vocab]

    def loss(self, batch) -> torch.Tensor:
        x, y = batch  # [B, T], [B, T]
        return self.model(
            x, targets=y, loss_chunk_tokens=self.loss_chunk_tokens, loss_impl=self.loss_impl
        )  # [] mean over B*T tokens

    def distilled_loss(self, batch) -> torch.Tensor:
        """(1 - w) cross-entropy + w KL(teacher || model), each a mean over the positions with a target."""
        x, y = batch  # [B, T], [B, T]
        (teacher,) = self.teacher
        if next(teacher.parameters()).device != x.device:
            teacher.to(x.device)
        logits = self.model(x).float()  # [B, T, V]
        with torch.no_grad():
            want = F.log_softmax(teacher(x).float(), dim=-1)  # [B, T, V]
        valid = y != IGNORE_INDEX  # [B, T]
        ce = F.cross_entropy(logits[valid], y[valid])  # []
        got = F.log_softmax(logits, dim=-1)  # [B, T, V]
        kl = F.kl_div(got[valid], want[valid], log_target=True, reduction="batchmean")  # [] mean over positions
        w = self.teacher_kl_weight
        return (1 - w) * ce + w * kl

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self.distilled_loss(batch) if self.teacher else self.loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch[0].shape[0])  # a tensor: read when logged
        return loss

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Once per optimizer step, after the backward of its last micro-batch: the global gradient
        norm (logged as train/grad_norm, before clipping), clipping by norm under DDP and FSDP alike,
        and the non-finite check, read in the step's one host sync (which also carries the stop
        protocol's request: t6.training.stop.any_rank)."""
        by_norm = gradient_clip_algorithm in (None, "norm")
        norm = clip_grad_norm(self.trainer.strategy.model, self, gradient_clip_val if by_norm else None)
        if not by_norm:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.log("train/grad_norm", norm, on_step=True, on_epoch=False)  # NaN on a skipped step
        if any_rank(self.trainer, torch.isfinite(norm).logical_not()):
            self.on_nonfinite_grad(norm)
        if self.trainer.global_step % self.trainer.log_every_n_steps == 0 and self.trainer.is_global_zero:
            lr = float(optimizer.param_groups[0]["lr"])  # straight to the loggers: no device tensor per step
            for logger in self.loggers:
                logger.log_metrics({"lr": lr}, step=self.trainer.global_step)

    def on_nonfinite_grad(self, norm: torch.Tensor) -> None:
        ckpt = self.trainer.checkpoint_callback
        last_good = getattr(ckpt, "final_path", None) or getattr(ckpt, "last_model_path", None) or None
        message = (
            f"non-finite gradient norm ({norm.item()}: a NaN or inf training loss on some rank) "
            f"at step {self.global_step}"
        )
        if self.nonfinite_loss == "stop":
            raise Diverged(
                f"{message}; stopping. "
                + (f"The last good checkpoint is kept: {last_good}. " if last_good else "No checkpoint was saved yet. ")
                + "Lower the learning rate, "
                "or set nonfinite_loss=skip to drop such steps"
            )
        for p in self.parameters():
            p.grad = None  # the optimizer skips parameters without a gradient: no update, no moment or decay change
        self.skipped_steps += 1
        self.log("train/skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False)  # a running count
        if self.global_rank == 0:
            log.warning("%s; skipping the update (%d steps so far)", message, self.skipped_steps)

    def validation_step(self, batch, batch_idx: int) -> None:
        tokens = (batch[1] != IGNORE_INDEX).sum()  # [] the padding rows of the last batch count for nothing
        self.val_loss.update(torch.where(tokens > 0, self.loss(batch), 0.0), weight=tokens)

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log_dict({"val/loss": loss, "val/ppl": torch.exp(loss)}, prog_bar=True, sync_dist=False)

    def configure_optimizers(self):
        if self.optimizer_factory is None:
            raise SettingError("no optimizer configured: set the `optimizer` config group")
        keywords = getattr(self.optimizer_factory, "keywords", {})
        optimizer = self.optimizer_factory(
            param_groups(self.model, keywords.get("weight_decay", 0.0), self.param_kinds)
        )
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler_factory(optimizer)}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.run_config is not None:
            checkpoint["run_config"] = self.run_config
        if self.tokenizer is not None:
            checkpoint["tokenizer"] = self.tokenizer  # t6.data.tokenizer.checkpoint_tokenizer reads it back
        for logger in self.loggers:
            if isinstance(logger, MLFlowLogger):
                checkpoint["mlflow_run_id"] = logger.run_id  # a resumed run continues this MLflow run
