"""The benchmarks' one harness: which mechanisms (`--attentions`), their parameter-matched configs,
dtypes, devices, timing, tables and JSON.

A mechanism's config is conf/attention/NAME.yaml x conf/size/SIZE.yaml composed by Hydra, as
training composes it (`heads.<size>` gives the parameter-matched head count). Ratios are to the
reference mechanism, `t6.model.attention.REFERENCE`, measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, open_dict

from t6.config import conf_dir, model_config
from t6.hardware.device import DTYPES
from t6.model import ModelConfig
from t6.model.attention import REFERENCE, get_attention_class, select
from t6.model.facts import kv_bytes_per_token


def compose(config_name: str, overrides: list[str] | tuple[str, ...] = (), runtime: bool = False) -> DictConfig:
    """conf/<config_name>.yaml composed with Hydra overrides. runtime: as under @hydra.main (the
    Hydra config set, so ${hydra:...} resolves, and no `hydra` node in the job's config)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from t6.run.cli import register

    register()  # as the entry scripts do before Hydra composes
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=list(overrides), return_hydra_config=runtime)
    if runtime:
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


def check_size(size: str) -> None:
    sizes = sorted(p.stem for p in (conf_dir() / "size").glob("*.yaml"))
    if size not in sizes:
        raise ValueError(f"size {size!r}: no conf/size/{size}.yaml; choose one of {sizes}")


def model_config_of(name: str, size: str, overrides: list[str] | tuple[str, ...] = ()) -> ModelConfig:
    """The ModelConfig of mechanism `name` at `size` (Hydra overrides such as size.n_layer=2 apply)."""
    check_size(size)
    get_attention_class(name)  # KeyError naming the registered mechanisms
    return model_config(compose("summary", [f"attention={name}", f"size={size}", *overrides]))


def model_configs(
    names: list[str], size: str, block_size: int | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> dict[str, ModelConfig]:
    """name -> ModelConfig at the given size, block_size replaced when given."""
    configs = {name: model_config_of(name, size, overrides) for name in names}
    if block_size is not None:
        configs = {name: dataclasses.replace(cfg, block_size=block_size) for name, cfg in configs.items()}
    return configs


def layer_kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes per token one layer's cache holds (t6.model.facts for a one-layer model)."""
    return kv_bytes_per_token(dataclasses.replace(cfg, n_layer=1), dtype)


def time_call(fn, steps: int, device: str | torch.device) -> float:
    """Seconds per call of fn, averaged over `steps` calls (CUDA synchronized before and after); no call and
    0.0 for steps=0 (a warm-up of none)."""
    if steps <= 0:
        return 0.0
    sync = (lambda: torch.cuda.synchronize(device)) if str(device).startswith("cuda") else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - start) / steps


def gpu_time_call(fn, steps: int, device: str | torch.device) -> float | None:
    """Seconds of GPU time per call of fn: the durations of the device's kernels, copies and fills over
    `steps` calls (torch.profiler), summed, over steps. The time the device is busy, which wall time
    exceeds by what the host adds (Python, dispatch, launches): a call bound by its host shows a wall
    time far above its GPU time. None off CUDA (the time is the host's there)."""
    if not str(device).startswith("cuda"):
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize(device)
    busy_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return busy_us / 1e6 / steps


def host_time_call(fn, steps: int, device: str | torch.device) -> float | None:
    """Seconds per call for fn to return without waiting for the device (CUDA): the host's own time
    (Python, dispatch, launches), as long as `steps` calls' launches fit in the device's queue. None
    off CUDA (the wall time is the host's time there)."""
    if not str(device).startswith("cuda"):
        return None
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize(device)
    return elapsed / steps


def copy_bandwidth_gbs(device: str | torch.device, mib: int = 1024) -> float:
    """The device's copy bandwidth in GB/s, read plus write (what a kernel that streams its inputs once
    can reach): the best of a few copies of a `mib` MiB buffer."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return max(2 * src.numel() / time_call(lambda: dst.copy_(src), 3, device) for _ in range(3)) / 1e9


def median(values: list[float]) -> float:
    return statistics.median(values)


def ratios_to_mha(records: list[dict], key: str, out: str) -> None:
    """records[out] = record[key] / the reference's (MHA's) record[key] (None when it was not measured)."""
    mha = next((r for r in records if r["attention"] == REFERENCE), None)
    for r in records:
        r[out] = r[key] / mha[key] if mha else None


def ints(text: str) -> list[int]:
    """ "1k,2k,16384" -> [1024, 2048, 16384]."""
    return [int(v[:-1]) * 1024 if v.lower().endswith("k") else int(v) for v in text.split(",") if v]


def attention_names(spec: str) -> list[str]:
    """--attentions: names, `paper` (the paper's six) and `all` (every registered), comma-separated."""
    try:
        return select(spec)
    except (KeyError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e).strip("'\"")) from None


def resolve_device(name: str) -> str:
    """`auto`: cuda when available, else cpu; any other name as given."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def attention_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--attentions",
        type=attention_names,
        default="paper",
        help="mechanism names, `paper` (the paper's six) and `all` (every registered), comma-separated",
    )


def common_args(
    parser: argparse.ArgumentParser, size: str = "medium", device: str = "cpu", dtype: str = "float32"
) -> None:
    """--attentions, --size, --device, --dtype, --threads, --json (defaults per benchmark)."""
    attention_args(parser)
    parser.add_argument("--size", default=size, help="model width from conf/size/NAME.yaml")
    parser.add_argument("--device", type=resolve_device, default=device, help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default=dtype, choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--json", type=Path, default=None, help="write the records to this JSON file")


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parser's arguments, with --threads applied."""
    args = parser.parse_args(argv)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    return args


def layer_args(parser: argparse.ArgumentParser, contexts: str, contexts_help: str) -> None:
    """The options of the one-layer inference benchmarks (decode, prefill): lengths, batch, scope."""
    parser.add_argument("--contexts", default=contexts, help=contexts_help)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--scope",
        default="attention",
        choices=["attention", "block"],
        help="one attention layer, or the whole decoder block (adds the norms and SwiGLU)",
    )


def table(records: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format) -> a fixed-width text table. A column whose key no record has is
    left out (GPU time on the CPU); a record without a value leaves its cell empty."""
    columns = [c for c in columns if any(c[0] in r for r in records)]
    cells = [[h for _, h, _ in columns]]
    for r in records:
        cells.append([("" if r.get(k) is None else format(r[k], f)) for k, _, f in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: Path | None, payload: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2))
        print(f"wrote {path}")


def machine_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's processor name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str) -> dict:
    """What a number was measured with, and when: the machine, torch, triton and CUDA versions, the device,
    CPU threads, the date (the tables of experiments/*/README.md name them)."""
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    return {
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "device": device if not device.startswith("cuda") else torch.cuda.get_device_name(device),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": machine_name(),
        "date": datetime.date.today().isoformat(),
    }
