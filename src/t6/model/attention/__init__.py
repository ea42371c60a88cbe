"""The attention zoo: one module per mechanism, each registering itself by name.

Adding a mechanism takes one Python file in this folder (a subclass of `Attention`
decorated with `@register("name")`) and one YAML file in `conf/attention/`. Modules here
are discovered automatically; nothing else needs editing.
"""

from __future__ import annotations

import importlib
import pkgutil

from t6.model.attention.base import Attention, KVCache, causal_mask, positive_int_options, register, registry

_discovered = False


def _discover() -> None:
    global _discovered
    if not _discovered:
        for module in pkgutil.iter_modules(__path__):
            if module.name != "base":
                importlib.import_module(f"{__name__}.{module.name}")
        _discovered = True


def get_attention_class(name: str) -> type[Attention]:
    _discover()
    if name not in registry:
        raise KeyError(f"attention={name!r} is not a known mechanism; choose one of {sorted(registry)}")
    return registry[name]


def available() -> list[str]:
    _discover()
    return sorted(registry)


__all__ = ["Attention", "KVCache", "available", "causal_mask", "get_attention_class", "positive_int_options", "register"]
