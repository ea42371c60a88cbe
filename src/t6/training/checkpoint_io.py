"""Checkpoint files: written atomically, in the background from a GPU, read without running pickled code.

`AtomicCheckpointIO` writes every checkpoint Lightning saves (periodic, `last.ckpt`, the one saved on
SIGTERM) to a temporary file in the same directory, fsyncs it and renames it over the old one, so a
crash mid-write leaves the previous checkpoint intact. Every checkpoint Lightning reads, including its
own resume path, goes through `torch.load(weights_only=True, mmap=True)`: the file is mapped, not
copied into each rank's RAM (ranks on one node share its pages). FSDP bypasses the CheckpointIO;
`t6.training.fsdp.T6FSDPStrategy` reads the same way.

`BackgroundCheckpointIO` (the Trainer's plugin, conf/trainer/default.yaml) writes through it from one writer
thread of its own. A checkpoint whose tensors are on a GPU is copied into host memory as it is at the save (a
point-in-time copy) and written by the writer. The copy does not stall the training thread either
(`HostStaging`): it goes into pinned host buffers kept from one save to the next (reserved ahead of the first
save by `reserve`, on the writer), issued on a side stream after the work queued so far, so the GPU goes on with
the next step's forward and backward while it runs; the next optimizer step, the first thing that changes the
state in place, waits for it on the GPU (a global optimizer pre-step hook), and the writer waits for it before
reading the buffers. Where pinned buffers cannot be had, the copy is the training thread's, into ordinary host
memory (`host_copy`: a stall of the copy's time). Saves, removals and links run in the order they were asked for,
each write still atomic. A checkpoint already in host memory (a CPU run) is written at once: copying it would
take the memory the step was planned with, and the cores that would write it in the background are the ones
training. `wait()` returns when every save asked for is on disk; `teardown()` (Lightning's, at the end of fit and
on any exception, a stop's save included) waits the same way, so no process exits with a checkpoint half written.
Where a background write (or the host copy) fails, the writer stops; the training thread warns
(t6.model.fallback "background_checkpoint"), writes that checkpoint and every call asked for after it
synchronously, in order, and writes synchronously from then on; an error of a synchronous write is the run's.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from t6.model import fallback
from t6.model.load import read_checkpoint

log = logging.getLogger(__name__)

FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)  # no room: the disk, the file size limit, the quota


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        """Write to a temporary file, fsync, rename over `path`. A disk without room for it (checked before the
        write, and met during it) is an OSError naming the file, the bytes needed and those free; the previous
        file stays whole."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        needed = checkpoint_bytes(checkpoint)
        free = shutil.disk_usage(path.parent).free
        if needed > free:
            raise no_room(errno.ENOSPC, path, needed, free)
        limit = file_size_limit()
        if limit is not None and needed > limit:
            raise no_room(errno.EFBIG, path, needed, free)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one, never half
        except (OSError, RuntimeError) as err:  # torch's writer says "unexpected pos", the OS's ENOSPC is its cause
            code = full_disk(err)
            if code is None:
                raise
            raise no_room(code, path, needed, shutil.disk_usage(path.parent).free) from err
        finally:
            tmp.unlink(missing_ok=True)

    def load_checkpoint(
        self, path, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        return read_checkpoint(path, "ckpt_path", map_location or "cpu", mmap=True)  # weights_only=True, never False


def checkpoint_bytes(checkpoint: dict[str, Any]) -> int:
    """The bytes of the checkpoint's tensors (each storage once): about the size of its file."""
    storages = {}
    apply_to_collection(checkpoint, torch.Tensor, lambda t: storages.setdefault(id_of(t), t.untyped_storage().nbytes()))
    return sum(storages.values())


def id_of(tensor: torch.Tensor) -> tuple:
    return (tensor.device.type, tensor.untyped_storage().data_ptr())


def full_disk(err: BaseException) -> int | None:
    """The errno of a full disk (ENOSPC, EFBIG, EDQUOT) in err or the errors it came from; None for another error."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in FULL:
            return err.errno
        err = err.__cause__ or err.__context__
    return None


def no_room(code: int, path: Path, needed: int, free: int) -> OSError:
    """The error of a checkpoint there is no room for, naming the file, the bytes needed and the fix: the disk's
    free space, or the process's file-size limit (EFBIG: `ulimit -f`, whatever the disk has free)."""
    mib = 2**20
    size = f"a checkpoint of {needed / mib:,.1f} MiB"
    if code == errno.EFBIG:
        limit = file_size_limit()
        cap = f"{limit / mib:,.1f} MiB" if limit is not None else "a limit"
        return OSError(
            code,
            f"{os.strerror(code)}: {size} exceeds this process's file-size limit of {cap} (`ulimit -f`; the disk has "
            f"{free / mib:,.1f} MiB free, the previous {path.name}, if any, is whole). Raise the limit (ulimit -f "
            "unlimited) before training",
            str(path),
        )
    return OSError(
        code,
        f"{os.strerror(code)}: {size} does not fit ({free / mib:,.1f} MiB free on its file system; the previous "
        f"{path.name}, if any, is whole). Free space there, or give the checkpoints a larger disk "
        "(callbacks.model_checkpoint.dirpath, or hydra.run.dir)",
        str(path),
    )


def file_size_limit() -> int | None:
    """The largest file this process may write, in bytes (RLIMIT_FSIZE's soft limit); None: no limit."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def remove_stale_writes(folder: str | Path) -> list[str]:
    """Remove what a killed process left half written in `folder` (`.NAME.PID.tmp`, `NAME.PID.link`); the caller
    holds the run directory, so no other process is writing there. Returns the names removed."""
    stale = [p for p in Path(folder).glob(".*.tmp") if p.is_file()] + list(Path(folder).glob("*.link"))
    for path in stale:
        path.unlink(missing_ok=True)
    return sorted(p.name for p in stale)


def on_gpu(checkpoint: dict[str, Any]) -> bool:
    """Whether any tensor of the checkpoint lives on an accelerator."""
    found = []
    apply_to_collection(checkpoint, torch.Tensor, lambda t: found.append(t.device.type != "cpu"))
    return any(found)


def host_copy(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint with every tensor copied into host memory, as it is now."""
    return apply_to_collection(checkpoint, torch.Tensor, lambda t: t.detach().to("cpu", copy=True))


Spec = tuple[tuple[int, ...], torch.dtype]  # a buffer's shape and dtype


def tensor_key(t: torch.Tensor) -> tuple:
    """What makes two tensors of a checkpoint the same one (tied weights: one storage, one view of it)."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def unique_tensors(checkpoint: Any) -> list[torch.Tensor]:
    """The checkpoint's tensors, each once (`tensor_key`), in the order met."""
    seen: dict[tuple, torch.Tensor] = {}
    apply_to_collection(checkpoint, torch.Tensor, lambda t: seen.setdefault(tensor_key(t), t))
    return list(seen.values())


class Staged:
    """One checkpoint's copy in a set of host buffers: `ready()` (the writer) waits for the copy, `release()`
    (after the write) hands the buffers back for a later save."""

    def __init__(self, staging: HostStaging, buffers: dict[Spec, list[torch.Tensor]], event):
        self.staging, self.buffers, self.event, self.released = staging, buffers, event, False

    def ready(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.staging.give_back(self.buffers)


class HostStaging:
    """Host buffers a checkpoint is copied into, kept from one save to the next (see the module docstring).

    A set holds one buffer per tensor of a checkpoint (matched by shape and dtype); it is busy from a copy until its
    write ends (`Staged.release`); a save while every set is busy gets a new one. Tensors on a GPU are copied into
    pinned buffers on a side stream, after the work queued on the current stream, and the next optimizer step
    waits for that copy on the GPU; tensors in host memory (a CPU run's, the optimizer's step counts) are copied at
    once, into ordinary buffers."""

    def __init__(self):
        self.lock = threading.Lock()
        self.free: list[dict[Spec, list[torch.Tensor]]] = []  # sets of buffers no write is using
        self.streams: dict[torch.device, Any] = {}  # a side stream per GPU
        self.pending: list[tuple[torch.device, Any]] = []  # copies the next optimizer step waits for (device, event)
        self.hook = None  # the optimizer pre-step hook while copies are pending

    @staticmethod
    def allocate(specs: list[tuple[Spec, bool]]) -> dict[Spec, list[torch.Tensor]]:
        """Buffers of these (shape, dtype), pinned where asked."""
        out: dict[Spec, list[torch.Tensor]] = {}
        for (shape, dtype), pinned in specs:
            out.setdefault((shape, dtype), []).append(torch.empty(shape, dtype=dtype, pin_memory=pinned))
        return out

    def reserve(self, tensors: list[torch.Tensor]) -> None:
        """A free set of buffers for a checkpoint of these tensors, allocated now (the writer, ahead of the first save:
        pinning gigabytes of host memory takes a while)."""
        buffers = self.allocate([((tuple(t.shape), t.dtype), t.device.type != "cpu") for t in tensors])
        with self.lock:
            self.free.append(buffers)

    def take(self, tensors: list[torch.Tensor]) -> dict[Spec, list[torch.Tensor]]:
        """A set of buffers holding one per tensor: a free set, topped up where it lacks some, else a new one."""
        with self.lock:
            buffers = self.free.pop() if self.free else {}
        have = {spec: len(b) for spec, b in buffers.items()}
        missing = []
        for t in tensors:
            spec = (tuple(t.shape), t.dtype)
            if have.get(spec, 0) > 0:
                have[spec] -= 1
            else:
                missing.append((spec, t.device.type != "cpu"))
        for spec, new in self.allocate(missing).items():
            buffers.setdefault(spec, []).extend(new)
        return buffers

    def give_back(self, buffers: dict[Spec, list[torch.Tensor]]) -> None:
        with self.lock:
            self.free.append(buffers)

    def copy(self, checkpoint: dict[str, Any]) -> tuple[dict[str, Any], Staged]:
        """The checkpoint with every tensor in a buffer of a set taken for it, as it is now (a GPU's tensors as the
        work queued so far leaves them), and its `Staged`."""
        tensors = unique_tensors(checkpoint)
        buffers = self.take(tensors)
        unused = {spec: list(b) for spec, b in buffers.items()}
        gpu = next((t.device for t in tensors if t.device.type == "cuda"), None)
        stream = None
        if gpu is not None:
            stream = self.streams.setdefault(gpu, torch.cuda.Stream(gpu))
            stream.wait_stream(torch.cuda.current_stream(gpu))  # after the step that made the state
        copies: dict[tuple, torch.Tensor] = {}
        for t in tensors:
            buf = unused[(tuple(t.shape), t.dtype)].pop()
            if t.device.type == "cuda":
                with torch.cuda.stream(stream):
                    buf.copy_(t.detach(), non_blocking=True)
                t.record_stream(stream)  # a temporary's memory is not reused before the copy is done
            else:
                buf.copy_(t.detach())
            copies[tensor_key(t)] = buf
        event = None
        if stream is not None:
            event = stream.record_event()
            self.wait_before_next_update(gpu, event)
        copied = apply_to_collection(checkpoint, torch.Tensor, lambda t: copies[tensor_key(t)])
        return copied, Staged(self, buffers, event)

    def wait_before_next_update(self, device: torch.device, event) -> None:
        """The next optimizer step (any optimizer: it changes the state in place) waits on the GPU for `event`."""
        self.pending.append((device, event))
        if self.hook is None:
            self.hook = torch.optim.optimizer.register_optimizer_step_pre_hook(self.before_update)

    def close(self) -> None:
        """No optimizer step waits for these copies any more (the writes they served are done)."""
        self.pending = []
        if self.hook is not None:
            self.hook.remove()
            self.hook = None

    def before_update(self, *_) -> None:
        for device, event in self.pending:
            torch.cuda.current_stream(device).wait_event(event)
        self.pending = []
        self.hook.remove()
        self.hook = None


class BackgroundCheckpointIO(CheckpointIO):
    """AtomicCheckpointIO's writes from a writer thread (see the module docstring). background: None writes
    checkpoints on a GPU in the background and the others at once; True or False, every one."""

    def __init__(self, background: bool | None = None, checkpoint_io: AtomicCheckpointIO | None = None):
        self.checkpoint_io = checkpoint_io or AtomicCheckpointIO()
        self.background = background
        self.executor: ThreadPoolExecutor | None = None  # one writer, started on the first write it takes
        self.error: BaseException | None = None  # the writer's, raised on the training thread
        self.failed: list[tuple] | None = None  # after a background write failed: it and the calls after it
        self.staging = HostStaging()  # host buffers a checkpoint is copied into, kept from save to save

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        self.raise_error()
        background = self.background if self.background is not None else on_gpu(checkpoint)
        if background and fallback.enabled("background_checkpoint"):
            try:
                copy, staged = self.stage(checkpoint)
            except Exception as err:  # host memory short: the checkpoint as it is, synchronously
                fallback.fell_back("background_checkpoint", err)
            else:
                self.submit(self.write_staged, copy, staged, path, storage_options)
                return
        self.wait()  # after the saves asked for earlier, in order
        self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options)

    def stage(self, checkpoint: dict[str, Any]) -> tuple[dict[str, Any], Staged | None]:
        """The checkpoint copied off the device as it is now: into the staging buffers, else (pinned memory short,
        t6.model.fallback "checkpoint_staging") by `host_copy` on this thread."""
        if fallback.enabled("checkpoint_staging"):
            try:
                return self.staging.copy(checkpoint)
            except Exception as err:
                fallback.fell_back("checkpoint_staging", err)
        return host_copy(checkpoint), None

    def write_staged(self, checkpoint: dict[str, Any], staged: Staged | None, path, storage_options=None) -> None:
        """The writer's part of a background save: wait for the copy, write, hand the buffers back."""
        try:
            if staged is not None:
                staged.ready()
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options)
        finally:
            if staged is not None:
                staged.release()

    def reserve(self, tensors: list[torch.Tensor]) -> None:
        """Staging buffers for a checkpoint holding these tensors (a training state's), allocated by the writer ahead
        of the first save; where that fails, the first save allocates them (or falls back) itself."""
        if not fallback.enabled("background_checkpoint") or not fallback.enabled("checkpoint_staging"):
            return
        tensors = unique_tensors(tensors)

        def reserve() -> None:
            try:
                self.staging.reserve(tensors)
            except Exception as err:  # e.g. pinned memory short: the save's own attempt decides
                log.info("checkpoint staging buffers not reserved ahead (%s: %s)", type(err).__name__, err)

        self.submit(reserve)

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        return self.checkpoint_io.load_checkpoint(path, map_location)

    def remove_checkpoint(self, path) -> None:
        """Removed after the saves asked for before (a file being written is not removed ahead of its rename)."""
        self.raise_error()
        self.submit(self.checkpoint_io.remove_checkpoint, path)

    def submit(self, fn, *args) -> None:
        """fn(*args) on the writer thread, after everything asked for before."""

        def run() -> None:
            if self.failed is not None:  # an earlier write failed: the training thread runs this one, in order
                self.failed.append((fn, args))
                return
            try:
                fn(*args)
            except Exception as err:  # the training thread warns and writes it again, at the next save or wait
                self.error, self.failed = err, [(fn, args)]
            except BaseException as err:  # raised on the training thread at the next save, wait or teardown
                self.error = err

        if self.executor is None:
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self.executor.submit(run)

    def wait(self) -> None:
        """Return when every save and removal asked for is done; raise the first error of one."""
        if self.executor is not None:
            self.executor.submit(lambda: None).result()
        self.raise_error()

    def teardown(self) -> None:
        """Wait for the writes, then stop the writer (a later write starts another) and free the staging buffers."""
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None
        self.staging.close()
        self.staging = HostStaging()
        self.raise_error()

    def raise_error(self) -> None:
        """After a background write failed: the fallback's warning, then that write and every call asked for after
        it on this thread, in order (their errors are the run's); any other error of the writer is raised."""
        if self.error is None:
            return
        if self.failed is not None and self.executor is not None:
            self.executor.submit(lambda: None).result()  # the calls still queued join self.failed
        err, calls, self.error, self.failed = self.error, self.failed, None, None
        if calls is None:
            raise err
        fallback.fell_back("background_checkpoint", err)
        for fn, args in calls:
            fn(*args)
