"""When an accelerator fails at its first use, the run goes on without it: never worse off than eager.

Each accelerator the platform uses has a name here (`ACCELERATORS`): what it is, what runs instead, and
the setting that turns it off. Where one fails (`fell_back`), the process

- logs one warning naming what failed, why (the error's type and first line) and that setting;
- records the event (`events()`; a training run logs each as `fallback/<name>` in MLflow,
  t6.training.callbacks.fallbacks.FallbackLog, through `subscribe`);
- and does not try that accelerator again (`enabled(name)` is False): the caller runs its eager path,
  which computes the same results (to float rounding where the kernels differ).

The eager path is not guarded: where it fails too (a shape bug, a full disk), its error is the run's error.

    if fallback.enabled("liger"):
        try:
            return liger_loss(...)
        except Exception as err:
            fallback.fell_back("liger", err)
    return chunked_loss(...)

`T6_EAGER` turns accelerators off before any is tried: a comma-separated list of names, or `all`
(`T6_EAGER=decode_graph,triton_decode python generate.py ...`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from t6.errors import SettingError

log = logging.getLogger(__name__)

ENV = "T6_EAGER"


@dataclass(frozen=True)
class Accelerator:
    what: str  # what it is
    instead: str  # what runs when it is off
    setting: str  # what turns it off


ACCELERATORS = {
    "compile": Accelerator("the compiled blocks (torch.compile, inductor)", "the eager blocks", "compile=false"),
    "decode_compile": Accelerator(
        "the compiled decode step (torch.compile, inductor)", "the eager decode step", f"{ENV}=decode_compile"
    ),
    "flex_decode": Accelerator(
        "FlexAttention in the compiled decode step", "SDPA with a mask in the compiled step", f"{ENV}=flex_decode"
    ),
    "decode_graph": Accelerator(
        "the decode step captured as a CUDA graph", "the decode step launched eagerly", f"{ENV}=decode_graph"
    ),
    "triton_decode": Accelerator(
        "the Triton decode kernels (t6::tpa_decode, t6::latent_decode)", "their eager reference", f"{ENV}=triton_decode"
    ),
    "triton_contract": Accelerator(
        "the Triton kernels of t6::tpa_contract (TPA's contraction in training, where turned on)",
        "their eager reference",
        f"{ENV}=triton_contract",
    ),
    "checkpoint_staging": Accelerator(
        "a checkpoint copied off the GPU into pinned buffers on a side stream",
        "the copy made on the training thread into ordinary host memory",
        f"{ENV}=checkpoint_staging",
    ),
    "background_checkpoint": Accelerator(
        "checkpoints written in the background",
        "checkpoints written synchronously",
        "trainer.plugins.0.background=false",
    ),
    "liger": Accelerator("Liger-Kernel's fused linear cross-entropy", "the chunked loss", "loss_impl=chunked"),
    "eval_batch_probe": Accelerator(
        "eval.batch_size=auto's memory probe", "a fixed evaluation batch", "eval.batch_size=<a number>"
    ),
}


@dataclass(frozen=True)
class Event:
    """One accelerator that failed: its name, the error, and the warning the process logged."""

    name: str
    error: str  # type: first line of the message

    def message(self) -> str:
        acc = ACCELERATORS[self.name]
        return (
            f"t6: {acc.what} failed at first use ({self.error}); running {acc.instead} instead, with the same "
            f"results. To skip it from the start: {acc.setting}"
        )


_lock = threading.Lock()
_failed: dict[str, Event] = {}
_listeners: list[Callable[[Event], None]] = []


def check(name: str) -> None:
    if name not in ACCELERATORS:
        raise KeyError(f"{name!r} is not an accelerator with a fallback; known: {sorted(ACCELERATORS)}")


def turned_off() -> set[str]:
    """The accelerators T6_EAGER names (`all`: every one); an unknown name is an error naming the known ones."""
    names = {n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()}
    if "all" in names:
        return set(ACCELERATORS)
    for name in names:
        if name not in ACCELERATORS:
            raise SettingError(f"{ENV}={os.environ[ENV]!r}: {name!r} is not one of all, {', '.join(ACCELERATORS)}")
    return names


def enabled(name: str) -> bool:
    """Whether to try accelerator `name`: not turned off (T6_EAGER) and not failed in this process."""
    check(name)
    return name not in _failed and name not in turned_off()


def describe(err: BaseException) -> str:
    """An error as one line: its type and the first line of its message."""
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    return f"{type(err).__name__}: {first[:300]}" if first else type(err).__name__


def fell_back(name: str, err: BaseException) -> Event:
    """Accelerator `name` failed with `err`: log the warning (once per process), record the event, tell the
    subscribers, and turn the accelerator off in this process. Returns the event."""
    check(name)
    with _lock:
        if name in _failed:
            return _failed[name]
        event = _failed[name] = Event(name, describe(err))
        listeners = list(_listeners)
    log.warning(event.message())
    for listener in listeners:
        listener(event)
    return event


def events() -> list[Event]:
    """The accelerators that failed in this process, in order."""
    with _lock:
        return list(_failed.values())


def subscribe(listener: Callable[[Event], None]) -> Callable[[], None]:
    """Call listener(event) for each later failure; returns the function that unsubscribes it."""
    with _lock:
        _listeners.append(listener)

    def unsubscribe() -> None:
        with _lock:
            if listener in _listeners:
                _listeners.remove(listener)

    return unsubscribe


def reset() -> None:
    """Forget every failure, so each accelerator is tried again (tests; a process that changed its setup)."""
    with _lock:
        _failed.clear()
