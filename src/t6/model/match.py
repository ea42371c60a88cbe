"""Mechanisms matched to a reference by one quantity: parameters, query heads, KV cache bytes per token or
training FLOPs per token (`CRITERIA`).

    matched = match(configured, reference, "kv_bytes", also=("params",))
    matched.model        # the configured model with its free sizes solved
    matched.describe()   # the matched quantity, and both models' parameters, heads, KV bytes and FLOPs

A model's free sizes are its query heads (`n_head`) and every positive integer option of its attention (its
`Options`: ranks, latent widths, KV groups, latent heads), except those its registered name fixes (MQA's one KV
head). The solver reads nothing else about a mechanism: each candidate's quantities are read off its attention
layer built on the meta device (t6.model.facts), so a new mechanism is matched with no code here.

The solution is, in this order of preference (`Objective`):
1. the criterion within `tolerance` of the reference's value (else as near as the integers allow);
2. each quantity of `also` within tolerance too, where the free sizes allow (else as near);
3. the fewest changes from the configured sizes: the smallest sum of |log(new / configured)| over the sizes.
The parameters' tolerance is `tolerance` or the configured sizes' own gap to the reference, whichever is larger:
a mechanism's configured sizes (conf/attention/NAME.yaml) are its parameter-matched point, so `params` keeps
them as they are, the gap its YAML accepts included (GTA small, +1.19%); an option of the `Options` base class
(the output gate), which the configured sizes did not count, is matched again.

The search moves the heads and at most one other free size at a time. For each pair it measures four valid
corners and models each quantity as bilinear in the two (exact for every quantity that is a sum of products of
sizes: projections' widths, cache shapes, matmul FLOPs), solves the other size for each head count, ranks the
candidates by the objective on the model's values, and measures them in that order (`SOLVE_MEASURES` at most)
until no unmeasured candidate can do better: the solution's numbers are always measured, never modelled.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, fields
from typing import Any

from t6.model.attention import Options, get_mechanism
from t6.model.config import ConfigError, ModelConfig

CRITERIA = ("params", "heads", "kv_bytes", "flops")
LABELS = {"params": "parameters", "heads": "query heads", "kv_bytes": "KV bytes/token", "flops": "FLOPs/token"}
SOLVE_MEASURES = 24  # candidates measured at most after the corners, per solve
PROBE = 8  # how far (in steps of 1) the corners of a pair are looked for around the configured sizes


def free_sizes(cfg: ModelConfig) -> dict[str, int]:
    """The sizes the solver may move: n_head, then every positive integer option the name does not fix."""
    mechanism = get_mechanism(cfg.attention)
    sizes = {"n_head": cfg.n_head}
    for f in fields(mechanism.cls.Options):
        value = cfg.attention_options.get(f.name)
        if f.name not in mechanism.preset and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            sizes[f.name] = value
    return sizes


def with_sizes(cfg: ModelConfig, sizes: dict[str, int]) -> ModelConfig | None:
    """cfg with these free sizes, or None where the mechanism's options refuse them (e.g. heads not divisible by
    the KV groups)."""
    options = {**cfg.attention_options, **{k: v for k, v in sizes.items() if k != "n_head"}}
    try:
        return dataclasses.replace(cfg, n_head=sizes.get("n_head", cfg.n_head), attention_options=options)
    except ConfigError:
        return None


def unadorned(cfg: ModelConfig) -> ModelConfig:
    """cfg with the options every mechanism inherits from `Options` (the output gate) at their defaults."""
    base = {f.name: f.default for f in fields(Options)}
    return dataclasses.replace(cfg, attention_options={**cfg.attention_options, **base})


def _key(cfg: ModelConfig) -> str:
    return json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)


_LAYER: dict[str, tuple[int, int]] = {}  # config -> (attention parameters, KV elements per token) of one layer
_LAYER_FLOPS: dict[str, float] = {}  # config -> one attention layer's training FLOPs per token
_WHOLE: dict[str, dict[str, float]] = {}  # config -> the whole model's parameters / FLOPs, measured once


class Meter:
    """The four quantities of model configs that differ from `base` only in their attention: a whole model is
    measured once (t6.model.facts), each candidate's attention layer on its own, and a candidate's total is the
    whole model's plus n_layer times its layer's difference from base's (every block holds the same layer)."""

    def __init__(self, base: ModelConfig):
        self.base = base

    def layer(self, cfg: ModelConfig) -> tuple[int, int]:
        from t6.model.facts import attention_layer, kv_elements_per_token

        key = _key(cfg)
        if key not in _LAYER:
            attn = attention_layer(cfg)
            _LAYER[key] = (sum(p.numel() for p in attn.parameters()), kv_elements_per_token(cfg))
        return _LAYER[key]

    def layer_flops(self, cfg: ModelConfig) -> float:
        from t6.model.facts import attention_flops_per_token

        key = _key(cfg)
        if key not in _LAYER_FLOPS:
            _LAYER_FLOPS[key] = attention_flops_per_token(cfg)
        return _LAYER_FLOPS[key]

    def whole(self, quantity: str) -> float:
        from t6.model.facts import flops_per_token, parameter_count

        measured = _WHOLE.setdefault(_key(self.base), {})
        if quantity not in measured:
            measured[quantity] = parameter_count(self.base) if quantity == "params" else flops_per_token(self.base)
        return measured[quantity]

    def __call__(self, cfg: ModelConfig, quantity: str) -> float:
        if quantity == "heads":
            return cfg.n_head
        if quantity == "kv_bytes":  # every layer, bf16 (2 bytes), as t6.model.facts.kv_bytes_per_token
            return self.layer(cfg)[1] * 2 * cfg.n_layer
        if quantity == "params":
            return self.whole("params") + cfg.n_layer * (self.layer(cfg)[0] - self.layer(self.base)[0])
        if quantity == "flops":
            return self.whole("flops") + cfg.n_layer * (self.layer_flops(cfg) - self.layer_flops(self.base))
        raise ValueError(f"unknown quantity {quantity!r}; one of {CRITERIA}")


@dataclass(frozen=True)
class Objective:
    """How a candidate ranks (lower is better, compared as a tuple, see the module docstring)."""

    quantities: tuple[str, ...]  # the criterion, then `also`
    targets: dict[str, float]
    tolerances: dict[str, float]
    start: dict[str, int]  # the configured free sizes

    def gap(self, quantity: str, value: float) -> float:
        return value / self.targets[quantity] - 1

    def __call__(self, sizes: dict[str, int], values: dict[str, float]) -> tuple:
        gaps = [abs(self.gap(q, values[q])) for q in self.quantities]
        outside = tuple(0.0 if g <= self.tolerances[q] + 1e-12 else g for q, g in zip(self.quantities, gaps))
        moved = sum(abs(math.log(sizes[k] / v)) for k, v in self.start.items())
        return (*outside, round(moved, 9), *gaps, tuple(sizes[k] for k in self.start))


@dataclass(frozen=True)
class Match:
    """A solved model: the configured one with its free sizes moved so that `criterion` equals the reference's."""

    criterion: str
    also: tuple[str, ...]
    tolerance: float
    configured: ModelConfig
    reference: ModelConfig
    model: ModelConfig
    measured: int  # models measured to solve it

    def changes(self) -> dict[str, tuple[int, int]]:
        """{size: (configured, solved)} for every free size that moved."""
        before, after = free_sizes(self.configured), free_sizes(self.model)
        return {k: (v, after[k]) for k, v in before.items() if after[k] != v}

    def quantities(self, cfg: ModelConfig, flops: bool = True) -> dict[str, float]:
        """params, heads, kv_bytes (and flops) of cfg, measured as the solver measures them."""
        meter = Meter(self.reference)
        return {q: meter(cfg, q) for q in CRITERIA if flops or q != "flops"}

    def gap(self, quantity: str = "") -> float:
        """The solution's relative difference from the reference in a quantity (default: the criterion)."""
        meter = Meter(self.reference)
        quantity = quantity or self.criterion
        return meter(self.model, quantity) / meter(self.reference, quantity) - 1

    def describe(self, flops: bool | None = None) -> str:
        """One line: the criterion and its gap, the sizes that moved, then both models' four quantities (FLOPs
        only where `flops`, by default where the criterion or `also` needs them: counting them takes seconds)."""
        flops = flops if flops is not None else "flops" in (self.criterion, *self.also)
        ours, ref = self.quantities(self.model, flops), self.quantities(self.reference, flops)
        name, ref_name = self.model.attention, self.reference.attention
        moved = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in self.changes().items()) or "sizes as configured"
        facts = "; ".join(
            f"{LABELS[q]} {_human(ours[q])} ({ref_name} {_human(ref[q])}, {ours[q] / ref[q] - 1:+.2%})" for q in ours
        )
        return f"{self.criterion} (tolerance {self.tolerance:.0%}): {moved}; {name} against {ref_name}: {facts}"

    def params(self) -> dict[str, Any]:
        """MLflow parameters: the criterion, the reference, each quantity of the solution and of the reference."""
        flops = "flops" in (self.criterion, *self.also)
        ours, ref = self.quantities(self.model, flops), self.quantities(self.reference, flops)
        out: dict[str, Any] = {"match/criterion": self.criterion, "match/reference": self.reference.attention}
        out |= {f"match/{q}": v for q, v in ours.items()} | {f"match/reference_{q}": v for q, v in ref.items()}
        out |= {f"match/changed/{k}": f"{a}->{b}" for k, (a, b) in self.changes().items()}
        return out


def _human(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:g}"


def match(
    configured: ModelConfig,
    reference: ModelConfig,
    criterion: str,
    also: tuple[str, ...] | list[str] = (),
    tolerance: float = 0.01,
) -> Match:
    """The configured model with its free sizes solved so that `criterion` (one of CRITERIA) equals the
    reference's within `tolerance`, then each of `also` where the sizes allow, moving them as little as possible
    (module docstring). The two configs must differ only in their attention and head count."""
    unknown = [q for q in (criterion, *also) if q not in CRITERIA]
    if unknown:
        raise ValueError(f"unknown match quantity {unknown}; choose from {list(CRITERIA)}")
    shared = [f.name for f in fields(ModelConfig) if f.name not in ("attention", "attention_options", "n_head")]
    differ = [name for name in shared if getattr(configured, name) != getattr(reference, name)]
    if differ:
        raise ValueError(f"the reference must have the model's sizes; they differ in {differ}")
    meter = Meter(reference)
    quantities = (criterion, *[q for q in also if q != criterion])
    targets = {q: meter(reference, q) for q in quantities}
    own = abs(meter(unadorned(configured), "params") / meter(reference, "params") - 1)
    tolerances = {q: max(tolerance, own) if q == "params" else tolerance for q in quantities}
    start = free_sizes(configured)
    objective = Objective(quantities, targets, tolerances, start)
    measured: dict[str, tuple[tuple, ModelConfig]] = {}

    def measure(cfg: ModelConfig) -> dict[str, float]:
        values = {q: meter(cfg, q) for q in quantities}
        measured.setdefault(_key(cfg), (objective(free_sizes(cfg), values), cfg))
        return values

    measure(configured)
    if not any(measured[_key(configured)][0][: len(quantities) + 1]):  # matched, no size moved: nothing is better
        return Match(criterion, tuple(quantities[1:]), tolerance, configured, reference, configured, 1)
    candidates = _candidates(configured, start, objective, measure)
    best = min(measured.values(), key=lambda m: m[0])
    checked = 0
    for predicted, sizes in sorted(candidates, key=lambda c: c[0]):
        if predicted >= best[0] or checked >= SOLVE_MEASURES:
            break
        cfg = with_sizes(configured, sizes)
        if cfg is None or _key(cfg) in measured:
            continue
        measure(cfg)
        checked += 1
        best = min(best, measured[_key(cfg)], key=lambda m: m[0])
    return Match(criterion, tuple(quantities[1:]), tolerance, configured, reference, best[1], len(measured))


def _corner(configured: ModelConfig, start: dict[str, int], name: str) -> tuple | None:
    """Second values h1 of n_head and g1 of `name`, near the configured ones, whose corners (h0|h1) x (g0|g1)
    are all valid models: (h1, g1, cfg(h1, g0), cfg(h0, g1), cfg(h1, g1)); None when there are none."""
    h0, g0 = start["n_head"], start[name]
    for dh in _steps():
        for dg in _steps():
            h1, g1 = h0 + dh, g0 + dg
            if h1 < 1 or g1 < 1:
                continue
            corners = [with_sizes(configured, {"n_head": h, name: g}) for h, g in ((h1, g0), (h0, g1), (h1, g1))]
            if all(c is not None for c in corners):
                return (h1, g1, *corners)
    return None


def _steps() -> list[int]:
    return [s for d in range(1, PROBE + 1) for s in (d, -d)]  # 1, -1, 2, -2, ...


def _predict(q00: float, coefficients: tuple[float, float, float], x: int, y: int) -> float:
    b, c, e = coefficients
    return q00 + b * x + c * y + e * x * y


def _candidates(configured, start, objective: Objective, measure) -> list[tuple[tuple, dict[str, int]]]:
    """(predicted objective, sizes) for the heads alone and for the heads with each other free size, each pair's
    quantities modelled as bilinear through its measured corners: Q(h0 + x, g0 + y) = Q00 + b x + c y + e x y."""
    h0, quantities, targets = start["n_head"], objective.quantities, objective.targets
    at = measure(configured)
    pairs: list[tuple[str, dict[str, tuple[float, float, float]]]] = []  # (other size or "", {q: (b, c, e)})
    h1 = next((h0 + s for s in _steps() if h0 + s >= 1 and with_sizes(configured, {"n_head": h0 + s})), None)
    if h1 is not None:  # the heads alone: Q(h) = Q(h0) + b (h - h0)
        one = measure(with_sizes(configured, {"n_head": h1}))
        pairs.append(("", {q: ((one[q] - at[q]) / (h1 - h0), 0.0, 0.0) for q in quantities}))
    for name in start:
        corner = _corner(configured, start, name) if name != "n_head" else None
        if corner is not None:
            hh, gg, c10, c01, c11 = corner
            q10, q01, q11 = measure(c10), measure(c01), measure(c11)
            dh, dg = hh - h0, gg - start[name]
            model = {}
            for q in quantities:
                b, c = (q10[q] - at[q]) / dh, (q01[q] - at[q]) / dg
                model[q] = (b, c, (q11[q] - q10[q] - q01[q] + at[q]) / (dh * dg))
            pairs.append((name, model))
    h_max = max(4 * h0, 4 * int(targets.get("heads", 0)), 64)
    out = []
    for name, model in pairs:
        g0 = start[name] if name else 0
        for h in range(1, h_max + 1):
            x = h - h0
            others = {g0}
            for q in quantities if name else ():  # the other size that meets each quantity at these heads
                b, c, e = model[q]
                if q != "heads" and c + e * x:
                    root = g0 + (targets[q] - at[q] - b * x) / (c + e * x)
                    others |= {math.floor(root) + d for d in (-1, 0, 1, 2)} if math.isfinite(root) else set()
            others |= {g0 + d for d in (-3, -2, -1, 1, 2, 3)} if name else set()
            for g in sorted(others):
                if name and not 1 <= g <= 64 * g0 + 4096:
                    continue
                y = g - g0
                values = {q: h if q == "heads" else _predict(at[q], model[q], x, y) for q in quantities}
                sizes = {**start, "n_head": h, **({name: g} if name else {})}
                out.append((objective(sizes, values), sizes))
    return out
