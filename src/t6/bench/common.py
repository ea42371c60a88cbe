"""What the benchmarks measure with: the mechanisms' parameter-matched configs, timing on the host and the
device, the device's copy bandwidth, ratios to the reference mechanism. Their command lines, tables, JSON
and printing are the harness's (t6.bench.harness).

A mechanism's config is conf/attention/NAME.yaml x conf/size/SIZE.yaml composed by Hydra, as
training composes it (`heads.<size>` gives the parameter-matched head count). Ratios are to the
reference mechanism, `t6.model.attention.REFERENCE`, measured in the same run.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
from omegaconf import DictConfig, open_dict

from t6.hydra_config import conf_dir, model_config
from t6.model import ModelConfig
from t6.model.attention import REFERENCE, get_attention_class
from t6.model.facts import kv_bytes_per_token


def compose(config_name: str, overrides: list[str] | tuple[str, ...] = (), runtime: bool = False) -> DictConfig:
    """conf/<config_name>.yaml composed with Hydra overrides. runtime: as under @hydra.main (the
    Hydra config set, so ${hydra:...} resolves, and no `hydra` node in the job's config)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from t6.cli import register

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


# The attention kernels a decode step may run, by the name the profiler gives their operator, as the benchmarks'
# rows name them (SDPA's math backend runs as matmuls and a softmax, named by none of these)
ATTENTION_KERNELS = {
    "t6::gqa_decode": "t6::gqa_decode",
    "t6::tpa_decode": "t6::tpa_decode",
    "t6::latent_decode": "t6::latent_decode",
    "aten::_scaled_dot_product_flash_attention": "SDPA flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "SDPA flash",
    "aten::_scaled_dot_product_efficient_attention": "SDPA memory-efficient",
    "aten::_scaled_dot_product_cudnn_attention": "SDPA cuDNN",
    "flex_attention": "FlexAttention",
}


def attention_kernels(fn, device: str | torch.device) -> str:
    """The attention kernels one call of fn runs (fn run once under torch.profiler): the fused decode operators
    with what implements them on `device` (Triton, C++, eager reference), SDPA's backends, FlexAttention; "matmul
    + softmax" where none of these ran."""
    from torch.profiler import ProfilerActivity, profile

    from t6.model.attention.fused_decode import implementation

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = list(dict.fromkeys(ATTENTION_KERNELS[e.name] for e in prof.events() if e.name in ATTENTION_KERNELS))
    names = [f"{n} ({implementation(device)})" if n.startswith("t6::") else n for n in names]
    return ", ".join(names) or "matmul + softmax"


def median(values: list[float]) -> float:
    return statistics.median(values)


def ratios_to_mha(records: list[dict], key: str, out: str) -> None:
    """records[out] = record[key] / the reference's (MHA's) record[key] (None when it was not measured)."""
    mha = next((r for r in records if r["attention"] == REFERENCE), None)
    for r in records:
        r[out] = r[key] / mha[key] if mha else None
