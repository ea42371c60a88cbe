"""The Hydra boundary: the general resolvers of the config files and the conversion of the composed
config into the plain dataclasses the model uses. Nothing under t6.model imports Hydra. (The uptrain
recipe's resolvers live with it, in t6.uptrain.recipe, which registers them when imported.)"""

from __future__ import annotations

import math
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from t6.model import ModelConfig


def _abspath(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def _ceil_mul(value: float, factor: float) -> int:
    return math.ceil(float(value) * float(factor))


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("t6.abspath"):
        OmegaConf.register_new_resolver("t6.abspath", _abspath)
    if not OmegaConf.has_resolver("t6.ceil_mul"):
        OmegaConf.register_new_resolver("t6.ceil_mul", _ceil_mul)  # ${t6.ceil_mul:x,f} = ceil(x * f), e.g. warmup steps


register_resolvers()


def model_config(cfg: DictConfig) -> ModelConfig:
    """ModelConfig from the `size` and `attention` groups; raises one ValueError naming every bad field."""
    size, attention = cfg.size, cfg.attention
    return ModelConfig(
        vocab_size=size.vocab_size,
        block_size=size.block_size,
        n_layer=size.n_layer,
        d_model=size.d_model,
        n_head=size.n_head,
        head_dim=size.head_dim,
        ffn_hidden=size.get("ffn_hidden"),
        attention=attention.name,
        attention_options=OmegaConf.to_container(attention.options, resolve=True) if attention.get("options") else {},
    )


def flatten(cfg: dict, prefix: str = "") -> dict[str, object]:
    """{"a": {"b": 1}} -> {"a.b": 1}: the resolved config as MLflow parameters."""
    flat = {}
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def project_root() -> Path:
    return Path(os.environ.get("T6_ROOT", ".")).resolve()
