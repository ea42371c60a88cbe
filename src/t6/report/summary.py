"""What a configured T6 costs, read off the built model rather than from formulas.

`summarize(cfg)` builds the model on the meta device (no memory, no compute) and reports
counted parameters (total, non-embedding, per block part), the KV cache its attention
declares (elements per token per layer, bytes per token for the whole model at a dtype),
and the FLOPs per token that `torch.utils.flop_counter.FlopCounterMode` counts on a forward
(and forward + backward) pass over one sequence. `python summary.py` is the command.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from t6.errors import SettingError
from t6.hardware.device import DTYPES
from t6.model import ModelConfig
from t6.model.facts import (
    flops_per_token,
    kv_bytes_per_token,
    kv_cache_spec,
    kv_elements_per_token,
    meta_model,
    parameter_count,
)


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def summarize(
    mcfg: ModelConfig,
    attention: str,
    size: str,
    cache_dtype: str = "bfloat16",
    seq_len: int | None = None,
    flops: bool = True,
) -> dict[str, Any]:
    """Parameters, KV cache and FLOPs of one configuration, as a flat dict (one JSON line)."""
    if cache_dtype not in DTYPES:
        raise SettingError(f"cache_dtype={cache_dtype!r} is not one of {sorted(DTYPES)}")
    dtype = DTYPES[cache_dtype]
    model = meta_model(mcfg)
    block = model.blocks[0]
    seq_len = seq_len or mcfg.block_size
    fwd, train = (
        (flops_per_token(model, seq_len, training=False), flops_per_token(model, seq_len)) if flops else (None, None)
    )
    return {
        "attention": attention,
        "size": size,
        "n_layer": mcfg.n_layer,
        "d_model": mcfg.d_model,
        "n_head": mcfg.n_head,
        "params": parameter_count(model),
        "params_non_embedding": parameter_count(model, non_embedding=True),
        "params_embedding": count(model.embed),
        "params_attention_per_block": count(block.attn),
        "params_ffn_per_block": count(block.ffn),
        "params_norms_per_block": count(block.attn_norm) + count(block.ffn_norm),
        "params_attention_parts": {name: count(child) for name, child in block.attn.named_children() if count(child)},
        "kv_cache": {name: list(shape) for name, shape in kv_cache_spec(model).items()},
        "kv_cache_elements_per_token_per_layer": kv_elements_per_token(model),
        "kv_cache_dtype": cache_dtype,
        "kv_cache_bytes_per_token": kv_bytes_per_token(model, dtype),
        "flops_seq_len": seq_len,
        "flops_per_token_forward": fwd,
        "flops_per_token_train": train,
    }


def human(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def format_table(row: dict[str, Any]) -> str:
    """A two-column table of one summary."""
    parts = ", ".join(f"{k} {human(v)}" for k, v in row["params_attention_parts"].items())
    cache = ", ".join(f"{k} {'x'.join(map(str, s))}" for k, s in row["kv_cache"].items())
    lines = [
        (
            "attention / size",
            f"{row['attention']} / {row['size']}  "
            f"({row['n_layer']} layers, d_model {row['d_model']}, {row['n_head']} heads)",
        ),
        ("parameters", f"{row['params']:,}  ({human(row['params'])})"),
        ("  non-embedding", f"{row['params_non_embedding']:,}"),
        ("  embedding (tied head)", f"{row['params_embedding']:,}"),
        ("  per block: attention", f"{row['params_attention_per_block']:,}  ({parts})"),
        ("  per block: SwiGLU", f"{row['params_ffn_per_block']:,}"),
        ("  per block: norms", f"{row['params_norms_per_block']:,}"),
        ("KV cache / token / layer", f"{row['kv_cache_elements_per_token_per_layer']:,} elements  ({cache})"),
        ("KV cache / token (model)", f"{row['kv_cache_bytes_per_token']:,} bytes at {row['kv_cache_dtype']}"),
        (
            f"FLOPs / token (T={row['flops_seq_len']})",
            f"forward {human(row['flops_per_token_forward'])}, forward+backward {human(row['flops_per_token_train'])}",
        ),
    ]
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in lines)


def render(row: dict[str, Any], output: str) -> str:
    if output == "json":
        return json.dumps(row)
    if output == "table":
        return format_table(row)
    raise SettingError(f"output={output!r} must be 'table' or 'json'")


COMPARISON = (
    "attention",
    "size",
    "layers x d_model",
    "heads",
    "params",
    "non-embedding",
    "KV elements / token / layer",
    "KV bytes / token",
    "forward GFLOP / token",
)


def comparison_table(rows: list[dict[str, Any]]) -> str:
    """One Markdown table of several summaries (`summary.py -m attention=... size=...`), a row each."""
    lines = ["| " + " | ".join(COMPARISON) + " |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        fwd = r.get("flops_per_token_forward")
        cells = [
            r["attention"],
            r["size"],
            f"{r['n_layer']} x {r['d_model']}",
            str(r["n_head"]),
            human(r["params"]),
            human(r["params_non_embedding"]),
            f"{r['kv_cache_elements_per_token_per_layer']:,}",
            f"{r['kv_cache_bytes_per_token']:,} ({r['kv_cache_dtype']})",
            f"{fwd / 1e9:.3f} (T={r['flops_seq_len']})" if fwd is not None else "–",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - Hydra is a dependency; the model side never needs it
    _HydraCallback = object


class ComparisonTable(_HydraCallback):
    """Hydra callback of summary.py: under -m with output=table, each job returns its summary and
    this prints them as one comparison table when the sweep ends (instead of one block per job)."""

    def __init__(self):
        self.rows: list[dict[str, Any]] = []

    def on_multirun_start(self, config, **kwargs) -> None:
        self.rows = []

    def on_job_end(self, config, job_return, **kwargs) -> None:
        from hydra.core.utils import JobStatus

        value = job_return.return_value if job_return.status == JobStatus.COMPLETED else None
        if isinstance(value, dict) and "attention" in value:
            self.rows.append(value)

    def on_multirun_end(self, config, **kwargs) -> None:
        if self.rows:
            print(comparison_table(self.rows), flush=True)


def main(cfg) -> dict[str, Any]:
    """summary.py: the costs of the model conf/summary.yaml composes, printed as a table or JSON; in a multirun
    the rows are printed together as one table at the end (ComparisonTable)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from t6.hydra_config import model_config

    row = summarize(model_config(cfg), cfg.attention.name, cfg.size.name, cfg.cache_dtype, cfg.flops_seq_len)
    if cfg.output == "table" and HydraConfig.get().mode == RunMode.MULTIRUN:
        return row  # ComparisonTable prints every job's row as one table at the end
    print(render(row, cfg.output), flush=True)
    return row
