"""The device and precision a run computes in, decided before the Trainer starts, each with its reason.

- `choose_device`: `trainer.accelerator` -> `cuda` or `cpu` (`auto`: a CUDA GPU when present).
- `choose_precision`: `trainer.precision: auto` -> `bf16-mixed` on a CUDA device with bf16 in
  hardware or a CPU with AMX bf16 tiles, `32-true` otherwise (an explicit precision is kept).
- `choose_compile`: `compile: auto` -> compile the blocks on CUDA, not on the CPU.
- `compute_dtype` / `param_dtype`: the dtypes a precision setting computes and stores in.
- `peak_flops`: the device's peak FLOP/s at a dtype, for MFU (Lightning's table, else a measured matmul).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

# The torch versions the code supports: the pinned one, and back to a GPU image's own (APIs newer than the
# oldest are used only where they exist, e.g. t6.model.t6.eager_backward_compile).
SUPPORTED_TORCH = ((2, 11), (2, 13))


def torch_supported(version: str = torch.__version__) -> bool:
    """Whether a torch version ("2.11.0+cu130") is within SUPPORTED_TORCH (major.minor, both ends included)."""
    major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    return SUPPORTED_TORCH[0] <= (major, minor) <= SUPPORTED_TORCH[1]


# Dtypes by the names the settings use (cache_dtype, the benchmarks' --dtype).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cuda_available() -> bool:
    """A CUDA device this process can use."""
    return torch.cuda.is_available()


def cuda_bf16_supported() -> bool:
    """bf16 in hardware (compute capability 8.0 and later). torch's default also says yes for older GPUs
    (V100, T4) that can hold bf16 tensors but compute them without tensor cores, far slower than fp32."""
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)


def cpu_amx_bf16() -> bool:
    """A CPU with AMX tiles (Xeon Sapphire Rapids and later): oneDNN runs bf16 matmuls on them, measured
    1.6x the fp32 rate on the head's [2048, 256] x [256, 50304] matmul and 1.3x a tiny training step."""
    return torch.cpu._is_amx_tile_supported() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def choose_device(accelerator: str, cuda: Callable[[], bool] | None = None) -> tuple[str, str]:
    """(device type, reason) for trainer.accelerator: `cuda` or `cpu` (other accelerators are named as given).
    cuda: whether a CUDA device is present (default `cuda_available`)."""
    accelerator = str(accelerator)
    if accelerator == "auto":
        if (cuda or cuda_available)():
            return "cuda", "accelerator=auto found a CUDA GPU"
        return "cpu", "accelerator=auto found no GPU"
    if accelerator in ("gpu", "cuda"):
        return "cuda", f"accelerator={accelerator}"
    return accelerator, f"accelerator={accelerator}"


def choose_precision(
    precision,
    device: str,
    bf16_supported: Callable[[], bool] | None = None,
    cpu_bf16: Callable[[], bool] | None = None,
) -> tuple[str, str]:
    """(precision, reason): `auto` becomes bf16-mixed on a CUDA device with bf16 or a CPU with AMX
    bf16 tiles, else 32-true (the probes default to `cuda_bf16_supported` and `cpu_amx_bf16`)."""
    bf16_supported, cpu_bf16 = bf16_supported or cuda_bf16_supported, cpu_bf16 or cpu_amx_bf16
    if precision is not None and str(precision) != "auto":
        return str(precision), "set explicitly (trainer.precision)"
    if device == "cuda":
        if bf16_supported():
            return "bf16-mixed", "precision=auto: the GPU supports bf16"
        return "32-true", "precision=auto: the GPU has no bf16 support"
    if device == "cpu":
        if cpu_bf16():
            return "bf16-mixed", "precision=auto: the CPU has AMX bf16 tiles"
        return "32-true", "precision=auto: the CPU has no AMX bf16 tiles"
    return "32-true", f"precision=auto on {device}"


def compute_dtype(precision: str) -> torch.dtype:
    p = str(precision)
    if p.startswith("bf16"):
        return torch.bfloat16
    if p.startswith("16"):
        return torch.float16
    if p.startswith("64"):
        return torch.float64
    return torch.float32


def param_dtype(precision: str) -> torch.dtype:
    """Mixed precision keeps fp32 parameters; `-true` precisions store them in that dtype."""
    return compute_dtype(precision) if str(precision).endswith("-true") else torch.float32


# The first training step compiles one graph for the blocks, and the first validation one more (no
# gradients); expected seconds for both. CPU: measured, tiny size on 2 cores (README, "Compiled
# training"); CUDA: not measured here, inductor's usual time for a decoder block's forward and backward.
EXPECTED_COMPILE_S = {"cuda": 60.0, "cpu": 40.0}


def choose_compile(setting, device: str) -> tuple[bool, str]:
    """(compile the blocks, reason) for `compile`: true, false or auto. auto compiles on CUDA, where
    compiled training measured 1.6x eager (medium TPA on an H100: 67-77k against 42-48k tokens/s), and not
    on the CPU, where compiling costs more than it saves on the runs a CPU makes (README, "Compiled
    training")."""
    if isinstance(setting, bool):
        return setting, f"compile={str(setting).lower()}"
    if device == "cuda":
        return True, "compile=auto on CUDA: compiled training measured 1.6x eager on an H100"
    return False, f"compile=auto on {device}: compiling costs more than it saves there"


def peak_flops(device: torch.device | str, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s of the device at dtype, where the number comes from) for MFU: Lightning's table of
    dense peaks for a CUDA GPU it knows (fp32 as TF32 unless the matmul precision is "highest"), else a
    measured matmul (`measured_matmul_flops`)."""
    from lightning.fabric.utilities.throughput import get_available_flops

    device = torch.device(device)
    if device.type == "cuda":
        table = get_available_flops(device, dtype)
        if table:
            return float(table), f"Lightning's table for {torch.cuda.get_device_name(device)}, {dtype}"
    flops = measured_matmul_flops(str(device), dtype)
    return flops, f"a measured {dtype} matmul on {device}"


@functools.cache
def measured_matmul_flops(device: str, dtype: torch.dtype) -> float:
    """FLOP/s of the fastest of eight square matmuls (2 n^3 FLOPs each; n = 8192 on a GPU, 1024 on the CPU)
    at this process's thread count, measured once per process."""
    n = 8192 if device.startswith("cuda") else 1024
    a = torch.randn(n, n, device=device).to(dtype)  # [n, n]
    b = torch.randn(n, n, device=device).to(dtype)  # [n, n]
    sync = (lambda: torch.cuda.synchronize(device)) if device.startswith("cuda") else (lambda: None)
    best = float("inf")
    for _ in range(9):  # the first warms up
        sync()
        start = time.perf_counter()
        a @ b  # [n, n]
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best
