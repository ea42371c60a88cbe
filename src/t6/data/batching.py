"""The global batch: how many sequences one optimizer step trains on, and how they are split.

    world size          = trainer.devices x trainer.num_nodes (one process per device)
    sequences per step  = data.global_batch_size                       when set
                        = data.batch_size x world size                 when null (no accumulation)
    per device          = sequences per step / world size
    accumulation        = per device / data.batch_size                 micro-batches per device and step

data.batch_size is the micro-batch: sequences per device and forward/backward pass (or auto, which
the memory preflight turns into a number and which then needs data.global_batch_size). Every place
that counts sequences or tokens per step (the data stream's position, uptraining's step count, a
checkpoint's tokens, reports) calls these, so the rule has one definition.
"""

from __future__ import annotations

from collections.abc import Sequence

from t6.errors import SettingError


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def batch_problems(batch_size, global_batch_size, seq_len) -> list[str]:
    """Every batch setting that cannot work, each naming its field (before any data is read)."""
    problems = []
    if batch_size != "auto" and not _positive_int(batch_size):
        problems.append(
            f"data.batch_size={batch_size!r} must be a positive number of sequences per device and micro-step, "
            "or auto (the largest that fits the device's memory); e.g. data.batch_size=8"
        )
    if global_batch_size is not None and not _positive_int(global_batch_size):
        problems.append(
            f"data.global_batch_size={global_batch_size!r} must be a positive number of sequences per "
            "optimizer step, or null (data.batch_size x devices)"
        )
    if batch_size == "auto" and global_batch_size is None:
        problems.append(
            "data.batch_size=auto needs data.global_batch_size (the sequences per optimizer step it keeps "
            "through gradient accumulation); set it, or give data.batch_size a number"
        )
    if not _positive_int(seq_len):
        problems.append(f"data.seq_len={seq_len!r} must be a positive number of tokens")
    return problems


def check_batch_settings(batch_size, global_batch_size, seq_len) -> None:
    """Raise naming every batch setting that cannot work."""
    problems = batch_problems(batch_size, global_batch_size, seq_len)
    if problems:
        raise SettingError("; ".join(problems))


def world_size(devices, num_nodes: int | None = 1) -> int | None:
    """trainer.devices x trainer.num_nodes as a number of processes; None when trainer.devices is not
    a count known from the config (auto, -1: decided at launch). A list of device ids counts its ids."""
    count = len(devices) if isinstance(devices, Sequence) and not isinstance(devices, str) else devices
    if not _positive_int(count):
        return None
    return count * int(num_nodes or 1)


def sequences_per_step(batch_size: int | str, global_batch_size: int | None, world_size: int | None) -> int:
    """Sequences one optimizer step trains on: global_batch_size when set, else batch_size x world_size."""
    if global_batch_size is not None:
        return int(global_batch_size)
    if batch_size == "auto":
        raise SettingError("data.batch_size=auto needs data.global_batch_size (the sequences per optimizer step)")
    if world_size is None:
        raise SettingError(
            "data.global_batch_size=null means data.batch_size x the number of devices, which is not a "
            "number here (trainer.devices=auto or -1); set data.global_batch_size or trainer.devices=N"
        )
    return int(batch_size) * int(world_size)


def sequences_per_device(batch_size: int | str, global_batch_size: int | None, world_size: int) -> int:
    """Sequences each of world_size devices handles per optimizer step: its share of the global batch."""
    if global_batch_size is None:
        return int(batch_size)
    if global_batch_size % world_size:
        raise SettingError(
            f"data.global_batch_size={global_batch_size} is not divisible by the world size {world_size}; "
            "change one of them"
        )
    return global_batch_size // world_size


def accumulation_steps(batch_size: int | str, global_batch_size: int | None, world_size: int) -> int:
    """Gradient-accumulation steps so that batch_size x world_size x steps = the global batch."""
    if batch_size == "auto":
        raise ValueError("data.batch_size=auto is resolved by the memory preflight before training (t6.run.plan)")
    if global_batch_size is None:
        return 1
    per_step = batch_size * world_size
    if global_batch_size % per_step:
        raise SettingError(
            f"data.global_batch_size={global_batch_size} is not divisible by data.batch_size={batch_size} "
            f"x world size {world_size}; change one of them"
        )
    return global_batch_size // per_step
