"""Where torch.compile keeps what it compiled, so that a second run of the same shapes loads it instead of
compiling again: inductor's FX-graph cache, AOTAutograd's cache (forward and backward graphs), the generated
kernels (C++ on the CPU, Triton on a GPU) and their autotuning results all live under inductor's cache directory
(`TORCHINDUCTOR_CACHE_DIR`), and Triton's own kernels (the decode kernels) in Triton's (`TRITON_CACHE_DIR`). By
default they are in /tmp and ~, which a fresh machine or a reboot empties; a run points both at a folder of the
project (`paths.compile_cache_dir`, default `<root>/.cache/compile`), for the run's duration (`compile_cache`).

- `cache_state(path)`: before compiling, how many compiled graphs the folder holds (the plan prints warm or cold).
- `cache_counts()`: after compiling, how many lookups this process hit and missed (`perf/compile_cache_hits`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from t6.hardware.probes import restored_environ

ENV = "TORCHINDUCTOR_CACHE_DIR"  # inductor's (torch._inductor.runtime.cache_dir_utils.cache_dir reads it at each use)
# Triton's own kernel cache (the decode kernels, t6.model.attention.triton_decode; inductor's kernels follow it too).
TRITON_ENV = "TRITON_CACHE_DIR"
# Its subfolders holding one entry per compiled graph: AOTAutograd's (a forward with its backward) and inductor's.
GRAPH_FOLDERS = ("aotautograd", "fxgraph")


@contextmanager
def compile_cache(path: str | os.PathLike | None) -> Iterator[None]:
    """torch.compile's and Triton's caches in `path` (created) while inside; as they were afterwards. None: left as
    they are. The setting wins over TORCHINDUCTOR_CACHE_DIR in the environment (unlike t6.run.process.environment's
    variables): inductor itself sets that variable to its default at its first compile in a process."""
    if path is None:
        yield
        return
    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    values = {ENV: str(path), TRITON_ENV: str(path / "triton")}
    with restored_environ(values):
        os.environ.update(values)
        yield


@dataclass(frozen=True)
class CacheState:
    path: str
    graphs: int  # entries in the folder's graph caches (GRAPH_FOLDERS)

    @property
    def warm(self) -> bool:
        return self.graphs > 0

    def describe(self) -> str:
        if self.warm:
            graphs = f"{self.graphs} compiled graph{'s' if self.graphs > 1 else ''}"
            return f"cache {self.path}: warm ({graphs} from earlier runs; the same shapes load)"
        return f"cache {self.path}: cold (empty; this run fills it, the next one of the same shapes loads)"


def cache_state(path: str | os.PathLike) -> CacheState:
    """The compiled graphs a cache folder holds now (one entry per graph and key; a missing folder holds none)."""
    path = Path(path).absolute()
    graphs = 0
    for name in GRAPH_FOLDERS:
        folder = path / name
        if folder.is_dir():
            graphs += sum(1 for _ in folder.iterdir())
    return CacheState(str(path), graphs)


def cache_counts() -> dict[str, int]:
    """This process's compile-cache lookups so far: AOTAutograd's (a graph with its backward, the first lookup) and
    inductor's FX-graph cache (reached on AOTAutograd's misses): hits and misses of each."""
    from torch._dynamo.utils import counters

    aot, inductor = counters["aot_autograd"], counters["inductor"]
    return {
        "aot_hits": int(aot["autograd_cache_hit"]),
        "aot_misses": int(aot["autograd_cache_miss"]),
        "fx_hits": int(inductor["fxgraph_cache_hit"]),
        "fx_misses": int(inductor["fxgraph_cache_miss"]),
    }
