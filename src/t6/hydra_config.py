"""The Hydra boundary: the general resolvers of the config files, each mechanism's options as Hydra's defaults, and
the conversion of the composed config into the plain dataclasses the model uses. Nothing under t6.model imports
Hydra. Importing this registers nothing: `t6.cli.register()` does (with the uptrain recipe's resolvers,
t6.uptrain.recipe), once, in every entry script before Hydra composes."""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import fields
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict

from t6.errors import ConfigError, MissingFile
from t6.model import ModelConfig
from t6.model.attention import available, get_mechanism, select
from t6.model.match import CRITERIA, Match, free_sizes, match


def _abspath(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def _ceil_mul(value: float, factor: float) -> int:
    return math.ceil(float(value) * float(factor))


def _attentions(*spec) -> str:
    """${t6.attentions:${compare}} or ${t6.attentions:paper,gta}: the mechanisms a spec selects
    (t6.model.attention.select: names, `paper`, `all`), as a sweep's comma-separated choices."""
    items = [str(i) for s in spec for i in (s if OmegaConf.is_list(s) or isinstance(s, list) else [s])]
    return ",".join(select(items))


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("t6.abspath"):
        OmegaConf.register_new_resolver("t6.abspath", _abspath)
    if not OmegaConf.has_resolver("t6.attentions"):
        OmegaConf.register_new_resolver("t6.attentions", _attentions)  # recipes' sweeps: ${t6.attentions:paper}
    if not OmegaConf.has_resolver("t6.ceil_mul"):
        OmegaConf.register_new_resolver("t6.ceil_mul", _ceil_mul)  # ${t6.ceil_mul:x,f} = ceil(x * f), e.g. warmup steps


def store_attention_options() -> None:
    """Each registered mechanism's options with their defaults (its `Options` dataclass, the
    name's preset applied) as the config `attention_options/<name>`: conf/attention/<name>.yaml
    takes it as `options` from its defaults list, so the defaults live in the Python file only
    and every option can be overridden as `attention.options.<field>=...`."""
    store = ConfigStore.instance()
    for name in available():
        store.store(group="attention_options", name=name, node=get_mechanism(name).default_options())


SIZE_KEYS = {"name"}  # the size's label (logs, run names)


def model_config(cfg: DictConfig) -> ModelConfig:
    """ModelConfig from the `size` and `attention` groups: every size.* key is a ModelConfig field
    (`name` aside), so `+size.rope_theta=500000` reaches the model and a misspelled key is an
    error; raises one ConfigError naming every bad field."""
    size = OmegaConf.to_container(cfg.size, resolve=True)
    model_fields = {f.name for f in fields(ModelConfig)} - {"attention", "attention_options"}
    unknown = [
        f"size.{key} is not a model setting" + (f" (did you mean size.{close[0]}?)" if close else "")
        for key in sorted(set(size) - model_fields - SIZE_KEYS)
        for close in [difflib.get_close_matches(key, sorted(model_fields), n=1)]
    ]
    attention = cfg.attention
    try:
        mcfg = ModelConfig(
            **{k: v for k, v in size.items() if k in model_fields},
            attention=attention.name,
            attention_options=OmegaConf.to_container(attention.options, resolve=True)
            if attention.get("options")
            else {},
        )
    except ConfigError as err:
        raise ConfigError(err.what, unknown + err.problems) from None
    if unknown:
        raise ConfigError("Invalid model config", unknown + [f"size.* takes {sorted(model_fields)}"])
    return mcfg


def reference_config(cfg: DictConfig, model: ModelConfig) -> ModelConfig:
    """The `match` group's reference (conf/match/*.yaml `reference`: an attention config, MHA by default) at the
    run's size: the model's sizes with the reference's attention, options and heads for size.name."""
    ref = cfg.match.reference
    heads = ref.get("heads") or {}
    if cfg.size.name not in heads:
        raise ConfigError(
            "Invalid match",
            [f"match.reference.heads has no entry for size.name={cfg.size.name} (attention={ref.name}); add one"],
        )
    options = OmegaConf.to_container(ref.options, resolve=True) if ref.get("options") else {}
    shape = {f.name: getattr(model, f.name) for f in fields(ModelConfig) if not f.name.startswith("attention")}
    return ModelConfig(**{**shape, "n_head": heads[cfg.size.name]}, attention=ref.name, attention_options=options)


def with_match(cfg: DictConfig) -> tuple[DictConfig, Match | None]:
    """The `match` group solved (t6.model.match) and its sizes written into cfg (size.n_head,
    attention.options.*; only those that move: under match=params none do, and cfg is the config as given).
    (cfg, None) without a match group, with a warm start (init_from: the converted model's shape) or when the
    model config itself is invalid (the run's checks name its problems)."""
    spec = cfg.get("match")
    if spec is None:
        return cfg, None
    problems = [] if spec.get("name") in CRITERIA else [f"match={spec.get('name')} must be one of {list(CRITERIA)}"]
    problems += [f"match.also: {q} is not one of {list(CRITERIA)}" for q in spec.get("also") or [] if q not in CRITERIA]
    tolerance = spec.get("tolerance")
    if not isinstance(tolerance, (int, float)) or isinstance(tolerance, bool) or not 0 <= tolerance < 1:
        problems.append(f"match.tolerance={tolerance!r} must be a number in [0, 1), e.g. 0.01")
    if cfg.get("init_from") and spec.get("name") != "params":
        problems.append(
            f"match={spec.name} resizes the model, but init_from trains the converted model's shape; use match=params"
        )
    if problems:
        raise ConfigError("Invalid match", problems)
    if cfg.get("init_from"):
        return cfg, None
    try:
        configured = model_config(cfg)
    except ConfigError:
        return cfg, None
    solved = match(configured, reference_config(cfg, configured), spec.name, tuple(spec.also or ()), tolerance)
    moved = {k: v for k, v in free_sizes(solved.model).items() if free_sizes(configured)[k] != v}
    with open_dict(cfg):
        for name, value in moved.items():
            if name == "n_head":
                cfg.size.n_head = value
            else:
                cfg.attention.options[name] = value
    return cfg, solved


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


def conf_dir() -> Path:
    """The project's conf/, for Hydra's compose API: beside src/ in a checkout (or an editable
    install), else under the project root (T6_ROOT, default the working directory)."""
    checkout = Path(__file__).resolve().parents[2] / "conf"  # src/t6/hydra_config.py -> repo root
    if checkout.is_dir():
        return checkout
    here = project_root() / "conf"
    if here.is_dir():
        return here
    raise MissingFile(
        f"no conf/ directory at {checkout} or {here}; run from the project's checkout "
        "or set T6_ROOT to the directory that holds conf/"
    )


def in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
