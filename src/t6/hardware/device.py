"""The device and precision a run computes in, decided before the Trainer starts, each with its reason.

- `choose_device`: `trainer.accelerator` -> `cuda` or `cpu` (`auto`: a CUDA GPU when present).
- `choose_precision`: `trainer.precision: auto` -> `bf16-mixed` on a CUDA device with bf16 in
  hardware or a CPU with AMX bf16 tiles, `32-true` otherwise (an explicit precision is kept).
- `compute_dtype` / `param_dtype`: the dtypes a precision setting computes and stores in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

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
