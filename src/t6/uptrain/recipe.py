"""The uptrain recipe's config side (conf/experiment/uptrain.yaml): the values it reads from a
converted checkpoint while the config is composed, and the config that names a warm start's model shape.

    ${t6.uptrain_steps:init_from,fraction,batch_size,global_batch_size,devices,num_nodes,seq_len}
        optimizer steps that train on `fraction` of the source's tokens at this run's global batch
    ${t6.source_lr:init_from,key,factor}
        factor x the source run's lr_ablation.<key>

`register_resolvers()` registers both (t6.cli.register, which every entry script's boundary calls). The dependency goes
one way: this module reads t6.hydra_config; t6.hydra_config knows nothing of uptraining.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, fields
from functools import lru_cache
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from t6.data.batching import sequences_per_step, world_size
from t6.errors import MissingFile, SettingError
from t6.hydra_config import model_config
from t6.model import ModelConfig
from t6.model.load import read_checkpoint

# Every ModelConfig field a size.* key sets (attention and its options come from the attention group).
MODEL_FIELDS = tuple(f.name for f in fields(ModelConfig) if not f.name.startswith("attention"))


def model_changes(cfg: DictConfig, model_cfg: dict) -> list[str]:
    """The size.* and attention settings a warm start's model (model_cfg) changes in cfg, which is left as it is."""
    return adopt_model_config(copy.deepcopy(cfg), model_cfg)


def with_model_config(cfg: DictConfig, model_cfg: dict) -> DictConfig:
    """A copy of cfg whose size.* and attention describe model_cfg: the run's name, tags and records then name the
    model it trains (cfg is left as it is)."""
    named = copy.deepcopy(cfg)
    adopt_model_config(named, model_cfg)
    return named


def adopt_model_config(cfg: DictConfig, model_cfg: dict) -> list[str]:
    """Write a warm start's model shape into `cfg` (size.* and attention.name/options; callers pass a copy).
    Returns the fields that changed."""
    changed = []
    with open_dict(cfg):
        for name in MODEL_FIELDS:
            default_width = int(8 * model_cfg["d_model"] / 3)
            if name == "ffn_hidden" and cfg.size.get(name) is None and model_cfg[name] == default_width:
                continue  # null means the default width, which the checkpoint has
            current = cfg.size.get(name, getattr(ModelConfig, name, None))  # absent: ModelConfig's default
            if current != model_cfg[name]:
                changed.append(f"size.{name}: {current} -> {model_cfg[name]}")
                cfg.size[name] = model_cfg[name]
        options = dict(model_cfg["attention_options"])
        current = dict(cfg.attention.get("options") or {})
        if cfg.attention.name != model_cfg["attention"] or current != options:
            changed.append(f"attention: {cfg.attention.name} {current} -> {model_cfg['attention']} {options}")
            cfg.attention.name = model_cfg["attention"]
            cfg.attention.options = options
    built = asdict(model_config(cfg))
    differ = [f"{k}={model_cfg.get(k)!r} (the config gives {v!r})" for k, v in built.items() if model_cfg.get(k) != v]
    if differ:
        raise SettingError(
            "init_from: the converted model's config cannot be expressed by size/attention: " + ", ".join(differ)
        )
    return changed


@lru_cache(maxsize=16)
def _warm_start_meta(path: str, mtime: float) -> dict:
    """A converted checkpoint's `source` and `source_run_config`, loaded once per file version
    (the uptrain recipe's resolvers read both while the config is composed)."""
    ckpt = read_checkpoint(path, "init_from", mmap=True)
    return {"source": ckpt["source"], "run_config": ckpt.get("source_run_config") or {}}


def converted_meta(init_from: str, needed_by: str) -> dict:
    """`source` and `run_config` of the converted checkpoint `init_from`, for the recipe value `needed_by`."""
    if not init_from:
        raise SettingError(f"{needed_by} needs init_from=PATH, a checkpoint written by `python convert.py`")
    path = Path(init_from)
    if not path.is_file():
        raise MissingFile(f"init_from={init_from!r} does not exist")
    return _warm_start_meta(str(path.resolve()), path.stat().st_mtime)


def uptrain_steps(
    init_from: str, fraction: float, batch_size, global_batch_size: int | None, devices, num_nodes, seq_len: int
) -> int:
    """Optimizer steps that train on `fraction` of the source's tokens at this run's global batch
    (t6.data.batching) and seq_len."""
    if not 0 < float(fraction):
        raise SettingError(f"uptrain_fraction={fraction} must be positive")
    source = converted_meta(init_from, "uptrain_fraction")["source"]
    if not source.get("tokens"):
        raise SettingError(
            f"init_from={init_from!r}: its source checkpoint does not record how many tokens it was trained on; "
            "set trainer.max_steps instead of uptrain_fraction"
        )
    try:
        sequences = sequences_per_step(batch_size, global_batch_size, world_size(devices, num_nodes))
    except ValueError as err:
        raise SettingError(f"uptrain_fraction counts tokens per step: {err}") from err
    return max(1, math.ceil(float(fraction) * source["tokens"] / (sequences * int(seq_len))))


def source_lr(init_from: str, key: str = "min_lr", factor: float = 1.0) -> float:
    """factor x the source run's lr_ablation.<key> (min_lr: the learning rate its schedule ended at),
    read from the converted checkpoint `init_from`."""
    run = converted_meta(init_from, f"lr_ablation.{key} from the source")["run_config"]
    value = (run.get("lr_ablation") or {}).get(key)
    if value is None:
        raise SettingError(
            f"init_from={init_from!r}: its source run config records no lr_ablation.{key}; "
            "set lr_ablation.max_lr and lr_ablation.min_lr explicitly"
        )
    return float(value) * float(factor)


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("t6.uptrain_steps"):
        OmegaConf.register_new_resolver("t6.uptrain_steps", uptrain_steps)
    if not OmegaConf.has_resolver("t6.source_lr"):
        OmegaConf.register_new_resolver("t6.source_lr", source_lr)
