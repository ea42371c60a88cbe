"""What training shows on the console: a plain line every few optimizer steps, on a terminal and in a log
file (nohup, SLURM logs, CI) alike, and the model summary. The lines read the loss only at logging steps,
so they force no host-device synchronization on every micro-batch."""

from __future__ import annotations

import sys
import time

import lightning as L
from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import get_formatted_model_size, get_human_readable_count

from t6.errors import SettingError


def is_terminal() -> bool:
    return sys.stdout.isatty()


def duration(seconds: float) -> str:
    """h:mm:ss, hours unbounded (one word for log parsers)."""
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


class ProgressLog(L.Callback):
    """One plain line every `every_n_steps` optimizer steps (default trainer.log_every_n_steps) and at
    the last step, on global rank 0 (`when: always`; `no_tty`: only when stdout is not a terminal; `never`):

        step 20/100 (20%) | loss 6.1234 | lr 3.00e-03 | 1,234 tok/s | elapsed 0:01:02 | ETA 0:04:08

    tokens/s counts every rank's tokens over the steps since the previous line; the ETA extrapolates
    this run's mean step time to trainer.max_steps."""

    WHEN = ("no_tty", "always", "never")

    def __init__(self, every_n_steps: int | None = None, when: str = "always"):
        if when not in self.WHEN:
            raise SettingError(f"callbacks.progress_log.when={when!r} must be one of {', '.join(self.WHEN)}")
        if every_n_steps is not None and every_n_steps < 1:
            raise SettingError(f"callbacks.progress_log.every_n_steps={every_n_steps} must be >= 1 (or null)")
        self.every_n_steps, self.when = every_n_steps, when
        self.active = False
        self._t0 = self._t_last = 0.0
        self._step0 = self._printed = 0
        self._tokens = self._tokens_last = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.active = trainer.is_global_zero and (
            self.when == "always" or (self.when == "no_tty" and not is_terminal())
        )
        self._t0 = self._t_last = time.perf_counter()
        self._step0 = self._printed = trainer.global_step
        self._tokens = self._tokens_last = 0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        if not self.active:
            return
        self._tokens += batch[0].numel() * trainer.world_size  # a shape, no sync
        step = trainer.global_step
        last = trainer.max_steps is not None and step == trainer.max_steps
        if step == self._printed or (step % (self.every_n_steps or max(trainer.log_every_n_steps, 1)) and not last):
            return
        self._printed = step
        print(self.line(trainer), flush=True)

    def line(self, trainer: L.Trainer) -> str:
        step, max_steps = trainer.global_step, trainer.max_steps
        loss = trainer.callback_metrics.get("train/loss")
        loss_text = f"{float(loss):.4f}" if loss is not None else "–"  # the one sync, at this logging step
        now = time.perf_counter()
        rate = (self._tokens - self._tokens_last) / max(now - self._t_last, 1e-9)
        self._t_last, self._tokens_last = now, self._tokens
        parts = [
            f"step {step}/{max_steps} ({100 * step / max_steps:.0f}%)"
            if max_steps and max_steps > 0
            else f"step {step}",
            f"loss {loss_text}",
        ]
        if trainer.optimizers:
            parts.append(f"lr {trainer.optimizers[0].param_groups[0]['lr']:.2e}")
        parts += [f"{rate:,.0f} tok/s", f"elapsed {duration(now - self._t0)}"]
        if max_steps and max_steps > 0 and step > self._step0:
            parts.append(f"ETA {duration((max_steps - step) * (now - self._t0) / (step - self._step0))}")
        return " | ".join(parts)


class ModelSummary(RichModelSummary):
    """Lightning's rich model summary without its FLOPs column and total, which read 0 for a module
    without an example input (FLOPs per token: `python summary.py`, counted by t6.model.facts)."""

    @staticmethod
    def summarize(
        summary_data,
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int = 0,
        **summarize_kwargs,
    ) -> None:
        from rich import get_console
        from rich.table import Table

        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            table.add_column(
                name,
                justify="right" if name in ("Params", "Params per Device") else "left",
                style="dim" if name == " " else None,
                no_wrap=name == "Name",
            )
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        console = get_console()
        console.print(table)
        grid = Table.grid(expand=True)
        grid.add_row(f"[bold]Trainable params[/]: {get_human_readable_count(int(trainable_parameters))}")
        grid.add_row(
            f"[bold]Non-trainable params[/]: {get_human_readable_count(int(total_parameters - trainable_parameters))}"
        )
        grid.add_row(f"[bold]Total params[/]: {get_human_readable_count(int(total_parameters))}")
        grid.add_row(f"[bold]Total estimated model params size (MB)[/]: {get_formatted_model_size(model_size)}")
        grid.add_row(f"[bold]Modules in train mode[/]: {total_training_modes['train']}")
        grid.add_row(f"[bold]Modules in eval mode[/]: {total_training_modes['eval']}")
        console.print(grid)
