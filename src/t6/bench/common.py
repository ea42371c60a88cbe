"""Shared pieces of the benchmarks: building parameter-matched configs by attention name,
timing, tables and JSON.

Head counts and options come from conf/attention/NAME.yaml (`heads.<size>`, `options`) when
that file exists; otherwise the options fall back to FALLBACK_OPTIONS and the head count is
the one whose attention layer has the parameter count closest to MHA's at that width (for
medium width: MQA 31, GQA 30 with 2 KV heads, TPA 47, TPA-KVonly 29).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from t6.model import ModelConfig
from t6.model.attention import available, get_attention_class

DEFAULT_ATTENTIONS = ("mha", "gqa", "mqa", "mla", "tpa_kvonly", "tpa")
FALLBACK_OPTIONS: dict[str, dict] = {"gqa": {"n_kv_head": 2}}


def conf_dir() -> Path:
    root = os.environ.get("T6_ROOT")
    return (Path(root) if root else Path(__file__).resolve().parents[3]) / "conf"


def size_config(size: str) -> dict:
    path = conf_dir() / "size" / f"{size}.yaml"
    if not path.exists():
        raise ValueError(f"--size {size}: no {path}; choose one of {sorted(p.stem for p in path.parent.glob('*.yaml'))}")
    cfg = OmegaConf.load(path)
    return {k: cfg[k] for k in ("n_layer", "d_model", "head_dim", "vocab_size", "block_size")}


def attention_params(cfg: ModelConfig) -> int:
    """Parameters of one attention layer (built on the meta device, nothing allocated)."""
    with torch.device("meta"):
        module = get_attention_class(cfg.attention)(cfg)
    return sum(p.numel() for p in module.parameters())


def matched_heads(name: str, options: dict, base: dict) -> int:
    """The head count whose attention layer has the parameter count closest to MHA's (h = d_model / d_h)."""
    target = attention_params(ModelConfig(attention="mha", n_head=base["d_model"] // base["head_dim"], **base))
    best = None
    for h in range(1, 4 * base["d_model"] // base["head_dim"] + 1):
        try:
            cfg = ModelConfig(attention=name, attention_options=options, n_head=h, **base)
        except ValueError:  # e.g. h not divisible by the KV groups
            continue
        gap = abs(attention_params(cfg) - target)
        if best is None or gap < best[0]:
            best = (gap, h)
    return best[1]


def attention_yaml(path: Path, size: str) -> dict:
    """conf/attention/NAME.yaml resolved as composed with size=`size` (options may depend on the size)."""
    cfg = OmegaConf.create({"size": {"name": size}, "attention": OmegaConf.load(path)})
    return OmegaConf.to_container(cfg, resolve=True)["attention"]


def model_configs(names: list[str], size: str, block_size: int | None = None, **overrides) -> dict[str, ModelConfig]:
    """name -> ModelConfig at the given size; names that are not registered are skipped with a message."""
    base = size_config(size)
    base.update(overrides)
    if block_size is not None:
        base["block_size"] = block_size
    registered = set(available())
    configs = {}
    for name in names:
        if name not in registered:
            print(f"skipped {name}: not a registered attention (registered: {', '.join(sorted(registered))})")
            continue
        path = conf_dir() / "attention" / f"{name}.yaml"
        yaml = attention_yaml(path, size) if path.exists() else {}
        options = yaml.get("options") or FALLBACK_OPTIONS.get(name, {})
        heads = (yaml.get("heads") or {}).get(size)
        if heads is None:
            heads = matched_heads(name, options, base)
        configs[name] = ModelConfig(attention=name, attention_options=options, n_head=heads, **base)
    return configs


def cache_bytes_per_token(module, dtype: torch.dtype) -> int:
    """Bytes per token of the cache the attention really allocates (one token, batch one)."""
    return module.build_kv_cache(1, 1, dtype, "cpu").nbytes()


def time_call(fn, steps: int, device: str) -> float:
    """Seconds per call of fn, averaged over `steps` calls."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - start) / steps


def median(values: list[float]) -> float:
    return statistics.median(values)


def ints(text: str) -> list[int]:
    """"1k,2k,16384" -> [1024, 2048, 16384]."""
    return [int(v[:-1]) * 1024 if v.lower().endswith("k") else int(v) for v in text.split(",") if v]


def common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--attentions", default=",".join(DEFAULT_ATTENTIONS),
                        help="comma-separated attention names (unregistered ones are skipped)")
    parser.add_argument("--size", default="medium", help="model width from conf/size/NAME.yaml")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--json", type=Path, default=None, help="write the records to this JSON file")


def layer_args(parser: argparse.ArgumentParser, contexts: str, contexts_help: str) -> None:
    """The options of the one-layer inference benchmarks (decode, prefill): lengths, batch, scope."""
    parser.add_argument("--contexts", default=contexts, help=contexts_help)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--scope", default="attention", choices=["attention", "block"],
                        help="one attention layer, or the whole decoder block (adds the norms and SwiGLU)")


def table(records: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format) -> a fixed-width text table."""
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


def environment(device: str) -> dict:
    return {
        "torch": torch.__version__,
        "device": device if not device.startswith("cuda") else torch.cuda.get_device_name(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
