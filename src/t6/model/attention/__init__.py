"""The attention zoo: one module per mechanism, each registering itself by name.

Adding a mechanism takes one Python file in this folder (a subclass of `Attention` with its
`Options` dataclass, decorated with `@register("name")`) and one YAML file in `conf/attention/`
(its head count per size). Modules here are discovered automatically; nothing else needs
editing: tests, summary, benchmarks and reports find it in the registry.
"""

from __future__ import annotations

import importlib
import pkgutil

from t6.errors import SettingError, UnknownName
from t6.model.attention.base import Attention, KVCache, Mechanism, Options, causal_mask, register, registry

_discovered = False


def _discover() -> None:
    global _discovered
    if not _discovered:
        for module in pkgutil.iter_modules(__path__):
            if module.name != "base":
                importlib.import_module(f"{__name__}.{module.name}")
        _discovered = True


def get_mechanism(name: str) -> Mechanism:
    """The registered name: its class and preset."""
    _discover()
    if name not in registry:
        raise UnknownName(f"attention={name!r} is not a known mechanism; choose one of {sorted(registry)}")
    return registry[name]


def get_attention_class(name: str) -> type[Attention]:
    return get_mechanism(name).cls


def available() -> list[str]:
    """Every registered mechanism, sorted."""
    _discover()
    return sorted(registry)


# The paper's comparison (Tables 2-3, Figures 2-4), in its order. Every recipe, benchmark and
# test that means "the paper's six" reads this; other mechanisms join a comparison by naming
# them next to it (`compare=[paper,gta]`, `--attentions paper,gta`), not by editing a list.
PAPER = ("mha", "mqa", "gqa", "mla", "tpa_kvonly", "tpa")
GROUPS = {"paper": PAPER}
# The baseline every comparison reads its ratios and differences against (benchmarks, reports).
REFERENCE = "mha"


def select(spec: str | list[str] | tuple[str, ...]) -> list[str]:
    """Mechanism names from a spec: names, `paper` (the paper's six) and `all` (every registered
    mechanism), comma-separated or as a list, e.g. "paper,gta". Each name once, in order; an
    unknown name is an error listing the known ones."""
    items = spec.split(",") if isinstance(spec, str) else [str(s) for s in spec]
    names: list[str] = []
    for item in (i.strip() for i in items if i.strip()):
        group = available() if item == "all" else GROUPS.get(item, (item,))
        for name in group:
            get_attention_class(name)  # KeyError naming the known mechanisms
            if name not in names:
                names.append(name)
    if not names:
        raise SettingError(f"no attention mechanism selected by {spec!r}; name some, or `paper` / `all`")
    return names


__all__ = [
    "GROUPS",
    "PAPER",
    "REFERENCE",
    "Attention",
    "KVCache",
    "Mechanism",
    "Options",
    "available",
    "causal_mask",
    "get_attention_class",
    "get_mechanism",
    "register",
    "select",
]
