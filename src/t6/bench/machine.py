"""The machine a measurement ran on: the device, the versions that matter, and its limits (copy bandwidth, matmul
peak), the suite's first stage (t6.bench.suite) and what the other stages' bounds read.

    python -m t6.bench.machine --json machine.json
"""

from __future__ import annotations

import importlib.metadata
import platform
from pathlib import Path

import torch

from t6.bench import harness
from t6.bench.common import copy_bandwidth_gbs
from t6.hardware.device import measured_matmul_flops, torch_supported

PACKAGES = ("torch", "triton", "lightning", "transformers", "hydra-core", "mlflow", "lm_eval", "liger_kernel", "numpy")


def versions() -> dict[str, str | None]:
    """The installed version of each package the measurements depend on (None: not installed)."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def measure(device: str) -> dict:
    """One record: the device's name, memory and processors, the copy bandwidth (read + write of a large buffer)
    and the fastest square matmul in fp32 (TF32 on CUDA, as training runs it) and bf16."""
    cuda = device.startswith("cuda")
    record = {"device": harness.environment(device)["device"], "cpu": harness.machine_name()}
    if cuda:
        props = torch.cuda.get_device_properties(device)
        record.update(
            memory_gib=props.total_memory / 2**30,
            processors=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
        )
        torch.set_float32_matmul_precision("high")
    else:
        record.update(processors=torch.get_num_threads())
    record["copy_bandwidth_gbs"] = copy_bandwidth_gbs(device, 1024 if cuda else 256)
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        record[f"matmul_tflops_{name}"] = measured_matmul_flops(device, dtype) / 1e12
    record.update(versions())
    record["torch_supported"] = torch_supported()  # within t6.hardware.device.SUPPORTED_TORCH
    return record


COLUMNS = [
    ("device", "device", ""),
    ("copy_bandwidth_gbs", "copy GB/s", ".1f"),
    ("matmul_tflops_float32", "fp32 matmul TFLOP/s", ".2f"),
    ("matmul_tflops_bfloat16", "bf16 matmul TFLOP/s", ".2f"),
    ("torch", "torch", ""),
    ("triton", "triton", ""),
]


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    parser.add_argument("--device", type=harness.resolve_device, default="auto", help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument("--json", type=Path, default=None, help="write the record to this JSON file")
    args = harness.parse(parser, argv)
    result = harness.result("machine", args.device, [measure(args.device)])
    harness.finish(result, COLUMNS, args.json)
    return result


if __name__ == "__main__":
    main()
