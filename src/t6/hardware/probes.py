"""What the machine and the launcher say about this process, read before anything is built: the memory
a training step may use (CPU MemAvailable capped by the cgroup's limit, CUDA `torch.cuda.mem_get_info`),
this process's resident size, and its global rank before any process group exists."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

GIB = 2**30


def gib(n: int | float) -> str:
    return f"{n / GIB:.2f} GiB"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text in ("", "max") else int(text)


def cgroup_free() -> int | None:
    """Bytes left under this process's cgroup memory limit (v2, then v1), None without a limit."""
    v2 = Path("/sys/fs/cgroup")
    limit, used = _read_int(v2 / "memory.max"), _read_int(v2 / "memory.current")
    if limit is None:
        v1 = v2 / "memory"
        limit, used = _read_int(v1 / "memory.limit_in_bytes"), _read_int(v1 / "memory.usage_in_bytes")
        if limit is not None and limit >= 2**60:  # v1's "no limit"
            limit = None
    if limit is None or used is None:
        return None
    return max(0, limit - used)


def meminfo_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def _status_bytes(field: str) -> int:
    """A `kB` field of /proc/self/status in bytes (0 where there is none)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def process_rss() -> int:
    """This process's resident set size in bytes (what it already holds before training)."""
    return _status_bytes("VmRSS")


def peak_rss() -> int:
    """This process's peak resident set size in bytes since it started its program (VmHWM).

    Not `ru_maxrss`: Linux carries the parent's high-water mark across exec into it, so a child
    started by a 2 GiB pytest process reports at least 2 GiB whatever it used itself."""
    return _status_bytes("VmHWM")


def available_memory(device: str, index: int = 0) -> tuple[int, str]:
    """(bytes a training step may use, where that number comes from)."""
    if device == "cuda":
        free, total = torch.cuda.mem_get_info(index)
        return free, f"torch.cuda.mem_get_info: {gib(free)} free of {gib(total)} on {torch.cuda.get_device_name(index)}"
    avail = meminfo_available()
    limit = cgroup_free()
    if limit is not None and limit < avail:
        return limit, f"cgroup memory limit: {gib(limit)} left"
    return avail, f"MemAvailable {gib(avail)}"


def env_rank() -> int:
    """Global rank from RANK (torchrun), LOCAL_RANK (Lightning's children), SLURM_PROCID; 0 otherwise.
    Same order as Lightning's rank_zero_only."""
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
        if os.environ.get(key) is not None:
            return int(os.environ[key])
    return 0


def env_local_rank() -> int:
    """This process's rank on its node, from the launcher's environment (LOCAL_RANK: torchrun and
    Lightning's children; SLURM_LOCALID); 0 otherwise."""
    for key in ("LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(key) is not None:
            return int(os.environ[key])
    return 0


@contextmanager
def restored_environ(keys: Iterable[str]) -> Iterator[None]:
    """os.environ's `keys` as they were when entered, restored on exit whatever happened meanwhile (set, changed or
    removed by the body or a library it calls)."""
    saved = {key: os.environ.get(key) for key in keys}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
