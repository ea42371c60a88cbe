"""Checkpoint files: written atomically, read without running pickled code, found for resume.

`AtomicCheckpointIO` is the Trainer's checkpoint plugin (conf/trainer/cpu.yaml): every
checkpoint Lightning writes (periodic, `last.ckpt`, the one saved on SIGTERM) goes to a
temporary file in the same directory, is fsync'ed and then renamed over the old one, so a
crash mid-write leaves the previous checkpoint intact. Every checkpoint Lightning reads,
including its own resume path, goes through `torch.load(weights_only=True, mmap=True)`: the file
is mapped, not copied into each rank's RAM (ranks on one node share its pages). FSDP bypasses
the CheckpointIO; `t6.fsdp.T6FSDPStrategy` reads the same way.
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


def checkpoint_dir(cfg) -> Path:
    """Where this run's ModelCheckpoint writes (the run directory's checkpoints/ by default)."""
    ckpt_cb = (cfg.get("callbacks") or {}).get("model_checkpoint")
    if ckpt_cb and ckpt_cb.get("dirpath"):
        return Path(ckpt_cb.dirpath)
    return Path(cfg.paths.output_dir) / "checkpoints"


def resolve_ckpt_path(cfg) -> str | None:
    """The checkpoint to resume from: `ckpt_path=PATH`; `ckpt_path=last` (this run directory's
    last.ckpt, which must exist); or, with `auto_resume=true` and no ckpt_path, last.ckpt when
    the run directory already has one (a re-run or requeued job with a fixed run dir)."""
    requested = cfg.get("ckpt_path")
    last = checkpoint_dir(cfg) / "last.ckpt"
    if requested == "last":
        if not last.is_file():
            raise FileNotFoundError(
                f"ckpt_path=last: {last} does not exist; point hydra.run.dir (or hydra.sweep.dir) at the "
                "interrupted run's directory, or give ckpt_path=/path/to/file.ckpt"
            )
        return str(last)
    if requested:
        if not Path(requested).exists():  # a directory is read (and refused, naming init_from=) by read_checkpoint
            raise FileNotFoundError(f"ckpt_path={requested!r} does not exist")
        return str(requested)
    if cfg.get("auto_resume", False) and last.is_file():
        return str(last)
    return None
