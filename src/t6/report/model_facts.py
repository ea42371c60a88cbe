"""Parameters and KV cache per token of a run's model: the values train() logged (model/...), else
t6.model.facts over the model rebuilt from the run's size.* and attention.* params."""

from __future__ import annotations

from t6.report.runs import RunData


def _unflatten(params: dict[str, str], prefixes: tuple[str, ...]) -> dict:
    import yaml

    tree: dict = {}
    for key, raw in params.items():
        if not key.startswith(prefixes):
            continue
        value = None if raw in ("None", "null") else yaml.safe_load(raw) if isinstance(raw, str) else raw
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def model_stats_from_params(params: dict[str, str]) -> dict[str, int]:
    """t6.model.facts.model_facts (params, KV cache bytes per token over all layers in bf16, ...) of the
    model the run's size.* and attention.* params describe, built on the meta device."""
    from omegaconf import OmegaConf

    from t6.hydra_config import model_config
    from t6.model.facts import model_facts

    cfg = OmegaConf.create(_unflatten(params, ("size.", "attention.")))
    if "size" not in cfg or "attention" not in cfg:
        raise KeyError("the run has no size.* / attention.* params to rebuild its model from")
    return model_facts(model_config(cfg))


def logged_fact(run: RunData, key: str) -> float | None:
    """A model fact the run logged (model/params, model/kv_cache_bytes_per_token), as a param or a metric."""
    value = run.param(key)
    if value is not None:
        return float(value)
    return run.metrics.get(key)
