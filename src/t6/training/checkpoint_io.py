"""Checkpoint files: written atomically, read without running pickled code.

`AtomicCheckpointIO` is the Trainer's checkpoint plugin (conf/trainer/cpu.yaml): every
checkpoint Lightning writes (periodic, `last.ckpt`, the one saved on SIGTERM) goes to a
temporary file in the same directory, is fsync'ed and then renamed over the old one, so a
crash mid-write leaves the previous checkpoint intact. Every checkpoint Lightning reads,
including its own resume path, goes through `torch.load(weights_only=True, mmap=True)`: the file
is mapped, not copied into each rank's RAM (ranks on one node share its pages). FSDP bypasses
the CheckpointIO; `t6.training.fsdp.T6FSDPStrategy` reads the same way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from t6.model.load import read_checkpoint


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one, never half
        finally:
            tmp.unlink(missing_ok=True)

    def load_checkpoint(
        self, path, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        return read_checkpoint(path, "ckpt_path", map_location or "cpu", mmap=True)  # weights_only=True, never False
