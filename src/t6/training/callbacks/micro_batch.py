"""The data-parallel ranks' agreement on the micro-batch each planned alone (data.batch_size=auto)."""

from __future__ import annotations

import lightning as L
import torch

from t6.errors import NoRoom


class SameMicroBatch(L.Callback):
    """Each rank planned its micro-batch from its own device's free memory before the processes met
    (t6.training.step_memory, data.batch_size=auto); data-parallel ranks must run the same one, or their collectives
    stop pairing up and training hangs without a word. At setup, where the process group exists, the
    ranks compare plans: different ones are an error on every rank, before the first step, naming the
    micro-batch that fits them all."""

    def __init__(self, batch: int, available: int):
        self.batch, self.available = batch, available

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.world_size == 1:
            return
        mine = torch.tensor([self.batch, self.available // 2**20], device=trainer.strategy.root_device)
        plans = trainer.strategy.all_gather(mine).reshape(-1, 2).tolist()  # [world, (micro-batch, MiB free)]
        if len({batch for batch, _ in plans}) > 1:
            each = ", ".join(f"rank {r}: {b} ({mib / 1024:.1f} GiB free)" for r, (b, mib) in enumerate(plans))
            fits = min(b for b, _ in plans)
            raise NoRoom(
                f"data.batch_size=auto planned different micro-batches on different devices ({each}); "
                f"data-parallel ranks must agree: set data.batch_size={fits}, which fits every device"
            )
