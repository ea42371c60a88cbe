"""The measured tables of experiments/*/README.md, rendered from the benchmark JSON beside them, so a number
has one owner: the JSON a benchmark wrote.

    python -m t6.report.experiments           # rewrite every table between its markers
    python -m t6.report.experiments --check   # exit 1 naming each table that differs from its JSON

A README declares a table by two markers around it, naming the JSON (relative to the README):

    <!-- table: decode_medium_t1_epyc.json -->
    (generated: the caption naming machine, versions and date, then the table)
    <!-- end table -->

The JSON's `benchmark` field (written by `python -m t6.bench.NAME --json ...`) picks the layout.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

MARKER = re.compile(r"(<!-- table: (?P<file>[^ ]+) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)


def k(n: float) -> str:
    """A context length as the benchmarks name them: 1024 -> 1k."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def caption(payload: dict) -> str:
    env = payload.get("environment", {})
    parts = [env.get("machine", "machine not recorded"), f"torch {env.get('torch', '?')}"]
    if env.get("triton"):
        parts.append(f"triton {env['triton']}")
    if env.get("device", "cpu") == "cpu" and env.get("threads"):
        parts.append(f"{env['threads']} thread(s)")
    elif env.get("device") not in (None, "cpu"):
        parts.insert(0, env["device"])
    parts.append(env.get("date", "date not recorded"))
    if payload.get("bandwidth_gbs"):
        parts.append(f"copy bandwidth {payload['bandwidth_gbs']:.1f} GB/s")
    if payload.get("peak_gflops"):
        parts.append(f"fp32 matmul {payload['peak_gflops']:.0f} GFLOP/s")
    return "*" + "; ".join(parts) + ".*"


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def by_attention(records: list[dict]) -> dict[str, list[dict]]:
    """Records grouped by mechanism, in the order the benchmark wrote them."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(r["attention"], []).append(r)
    return groups


def decode_table(payload: dict) -> str:
    """Tokens/s of one decode step per mechanism and context (ratio to the run's reference, fraction of the
    mechanism's own roofline where the benchmark measured the machine's limits)."""
    records = payload["records"]
    contexts = sorted({r["context"] for r in records})
    roofline = any("fraction_of_roofline" in r for r in records)
    header = ["attention", "heads", f"cache B/token/layer ({payload.get('dtype', 'float32')})"]
    header += ["FLOP/cached token"] if any("flops_per_cached_token" in r for r in records) else []
    header += ["attention kernel", "CUDA graph"] if any("kernel" in r for r in records) else []
    header += [k(c) for c in contexts]
    rows = []
    for name, group in by_attention(records).items():
        first = group[0]
        row = [name, str(first["n_head"]), str(first["kv_cache_bytes_per_token"])]
        if "FLOP/cached token" in header:
            row.append(f"{first.get('flops_per_cached_token', 0):.0f}")
        if "attention kernel" in header:
            row += [str(first.get("kernel", "")), str(first.get("graph", ""))]
        at = {r["context"]: r for r in group}
        for c in contexts:
            r = at.get(c)
            if r is None:
                row.append("")
                continue
            allowed = f" of {r['roofline_vs_mha']:.2f}×" if r.get("roofline_vs_mha") is not None else ""
            extra = f", {r['fraction_of_roofline']:.2f}" if roofline and "fraction_of_roofline" in r else ""
            row.append(f"{r['tokens_per_s']:.1f} ({r['speed_vs_mha']:.2f}×{allowed}{extra})")
        rows.append(row)
    allows = any(r.get("roofline_vs_mha") is not None for r in records)
    what = "tokens/s (ratio to MHA" + (" of the ratio the two rooflines allow" if allows else "")
    what += ", fraction of the mechanism's roofline)" if roofline else ")"
    return f"{caption(payload)} Cells: {what}, batch {records[0]['batch']}.\n\n{markdown(header, rows)}"


def prefill_table(payload: dict) -> str:
    records = payload["records"]
    contexts = sorted({r["context"] for r in records})
    rows = []
    for name, group in by_attention(records).items():
        at = {r["context"]: r for r in group}
        rows.append([name] + [f"{at[c]['tokens_per_s']:.0f} ({at[c]['speed_vs_mha']:.2f}×)" for c in contexts])
    header = ["attention"] + [k(c) for c in contexts]
    return f"{caption(payload)} Cells: tokens/s (ratio to MHA).\n\n{markdown(header, rows)}"


def kv_memory_table(payload: dict) -> str:
    header = [
        "size",
        "attention",
        "heads",
        "numbers/token/layer",
        f"cache bytes/token ({payload['dtype']}, all layers)",
        "× smaller than MHA",
        f"max context in {payload['budget_gib']:g} GiB",
    ]
    rows = [
        [
            r["size"],
            r["attention"],
            str(r["n_head"]),
            str(r["elements_per_token_layer"]),
            f"{r['kv_cache_bytes_per_token']:,}",
            f"{r['smaller_than_mha']:.2f}",
            f"{r['max_context']:,}",
        ]
        for r in payload["records"]
    ]
    return f"{caption(payload)}\n\n{markdown(header, rows)}"


def mfu_vs_mha(record: dict, records: list[dict]) -> float | None:
    """A record's MFU over MHA's in the same run (records written before the benchmark recorded it included)."""
    mha = next((r for r in records if r["attention"] == "mha" and r.get("mfu")), None)
    if record.get("mfu_vs_mha") is not None:
        return record["mfu_vs_mha"]
    return None if mha is None or record.get("mfu") is None else record["mfu"] / mha["mfu"]


def train_step_table(payload: dict) -> str:
    header = ["attention", "heads", "ms/step", "tokens/s", "vs MHA", "GFLOP/token", "MFU", "MFU vs MHA"]
    rows = [
        [
            r["attention"],
            str(r["n_head"]),
            f"{r['step_ms']:.0f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['ratio_to_mha']:.3f}",
            f"{r['flops_per_token_train'] / 1e9:.3f}",
            "" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%",
            "" if mfu_vs_mha(r, payload["records"]) is None else f"{mfu_vs_mha(r, payload['records']):.3f}",
        ]
        for r in payload["records"]
    ]
    r0 = payload["records"][0]
    shape = f"batch {r0['batch_size']} × {r0['seq_len']} tokens, {r0['dtype']}"
    peak = f", MFU against {payload['peak_tflops']} TFLOP/s" if payload.get("peak_tflops") else ""
    return f"{caption(payload)} {shape}{peak}.\n\n{markdown(header, rows)}"


def memory_table(payload: dict) -> str:
    """The memory preflight's estimate beside the measured peak of real training steps."""
    gib = 2**30
    header = ["size", "micro-batch", "precision", "estimate", "measured", "estimate / measured", "measured as"]
    rows = [
        [
            r["size"],
            f"{r['batch']} × {r.get('seq_len', '')}".rstrip(" ×"),
            r["precision"],
            f"{r['estimate'] / gib:.2f} GiB",
            f"{r['measured'] / gib:.2f} GiB",
            f"{r['ratio']:.2f}",
            r["measure"],
        ]
        for r in payload["records"]
    ]
    return f"{caption(payload)} Attention {payload['records'][0]['attention']}.\n\n{markdown(header, rows)}"


def export_table(payload: dict) -> str:
    """An exported model's accuracies: the training run's, the `t6` adapter's and lm-eval's `hf` model's."""
    machine, versions = payload["machine"], payload["versions"]
    caption_ = "*" + "; ".join(
        [
            f"{machine['cores']} cores of an {machine['cpu']}",
            *(f"{k} {v}" for k, v in versions.items()),
            payload["date"],
        ]
    )
    header = [
        "task",
        "shots",
        "metric",
        "the run",
        "`t6` adapter",
        "`hf`, logits_cache=False",
        "`hf`, lm-eval's default",
    ]
    rows = []
    for r in payload["table"]:
        cached = f"{r['hf_logits_cache']:.4f}"
        rows.append(
            [
                r["task"],
                str(r["shots"]),
                r["metric"],
                *(f"{r[k]:.4f}" for k in ("run", "t6", "hf")),
                cached if r["hf_logits_cache"] == r["hf"] else f"**{cached}**",
            ]
        )
    return f"{caption_}.*\n\n{markdown(header, rows)}"


PRETRAINED_POINTS = (("start", "as converted"), ("distilled", "distilled"), ("uptrained", "uptrained"))
CHANCE = 0.25  # the local tasks' four choices


def pretrained_table(payload: dict) -> str:
    """experiments/pretrained: the imported source, then each conversion at three points (as converted, after
    distillation, after uptraining). Two tables: what each point is and cost (KV cache, validation loss, tokens,
    minutes), then every local task on its own: the accuracy 0-/2-shot and the share of the source's accuracy
    above chance it keeps, with the items' standard error (`kept`)."""
    env, steps = payload["environment"], payload["steps"]
    versions = [
        f"{name} {env[name]}" for name in ("torch", "transformers", "tokenizers", "lm_eval", "gguf") if name in env
    ]
    caption_ = f"*{env['machine']}; Python {env['python']}, {', '.join(versions)}"
    caption_ += (f"; commit {env['commit']}" if env.get("commit") else "") + f"; {env['date']}.*"
    source_kv = steps["source/facts"]["kv_bytes_per_token"]
    src = steps["source/eval"]["metrics"]
    tasks = pretrained_tasks(src)
    items = pretrained_items(payload, tasks)

    points = []  # (model, point, kv, val loss, metrics, tokens, minutes)
    imported = steps["import"]
    points.append(("SmolLM2-135M (GQA)", "imported", source_kv, imported["source_val_loss"], src, "-", "-"))
    if "source/lm_eval_hf" in steps:  # the same items scored by lm-eval's own hf model on the GGUF file
        hf = steps["source/lm_eval_hf"]
        points.append(
            ("SmolLM2-135M (GQA)", "lm-eval `hf`", source_kv, None, hf["metrics"], "-", f"{hf['minutes']:.1f}")
        )
    for target in payload["settings"]["targets"]:
        if f"{target}/facts" not in steps:
            continue
        kv = steps[f"{target}/facts"]["kv_bytes_per_token"]
        for point, label in PRETRAINED_POINTS:
            evaluated = steps.get(f"{target}/{point}/eval", {"metrics": {}})  # as converted: the tasks are optional
            if point == "uptrained" and f"{target}/uptrained/val" not in steps:
                continue
            if point == "distilled" and f"{target}/distill" not in steps:
                continue
            if point == "uptrained":
                up = steps[f"{target}/uptrain"]
                loss, spent = (
                    steps[f"{target}/uptrained/val"]["val_loss"],
                    (f"{up['tokens']:,}", f"{up['minutes']:.1f}"),
                )
            else:
                conv = steps[f"{target}/convert" if point == "start" else f"{target}/distill"]
                loss, spent = conv["val_loss"], (f"{conv['calibration_tokens']:,}", f"{conv['minutes']:.1f}")
            points.append((target, label, kv, loss, evaluated["metrics"], *spent))
        if f"{target}/export/lm_eval_hf" in steps:  # the uptrained model exported, scored by lm-eval's own hf model
            hf = steps[f"{target}/export/lm_eval_hf"]
            points.append((target, "exported, lm-eval `hf`", kv, None, hf["metrics"], "-", f"{hf['minutes']:.1f}"))

    costs = [
        [model, point, f"{kv:,} ({kv / source_kv:.2f})", "-" if loss is None else f"{loss:.3f}", tokens, minutes]
        for model, point, kv, loss, _, tokens, minutes in points
    ]
    header = ["model", "point", "KV B/token (x source)", "val loss", "tokens", "minutes"]
    per_task = []
    for model, point, _, _, metrics, _, _ in points:
        row = [model, point]
        for task, metric in tasks:
            for shots in (0, 2):
                row.append(task_cell(metrics, src, task, metric, shots, items[task]))
        per_task.append(row)
    task_header = ["model", "point"]
    task_header += [f"{task} ({metric}) {shots}-shot" for task, metric in tasks for shots in (0, 2)]
    note = (
        "Each task on its own: accuracy, then in brackets the share of the source's accuracy above chance (0.25) the "
        "point keeps, (acc - 0.25) / (source - 0.25), ± the standard error of its items, sqrt(acc (1 - acc) / n) / "
        "(source - 0.25), n = " + ", ".join(f"{n} ({task})" for task, n in items.items()) + " items."
    )
    return f"{caption_}\n\n{markdown(header, costs)}\n\n{note}\n\n{markdown(task_header, per_task)}"


def pretrained_tasks(source_metrics: dict) -> list[tuple[str, str]]:
    """(task, metric) of every local task the source was evaluated on, in the order it logged them; the metric
    the eval config reports it by (t6.report.evals.task_metric)."""
    from t6.report.evals import task_metric

    tasks: dict[str, set[str]] = {}
    for key in source_metrics:
        parts = key.split("/")
        if len(parts) == 4 and parts[0] == "eval":
            tasks.setdefault(parts[2], set()).add(parts[3])
    return [(task, task_metric(task, metrics)) for task, metrics in tasks.items()]


def pretrained_items(payload: dict, tasks: list[tuple[str, str]]) -> dict[str, int]:
    """Items scored per task: the study's eval limit, capped by the task's own size where the study records it."""
    settings = payload["settings"]
    sizes = settings.get("task_items") or {}
    return {task: min(settings["eval_limit"], sizes.get(task, settings["eval_limit"])) for task, _ in tasks}


def task_cell(metrics: dict, source: dict, task: str, metric: str, shots: int, n: int) -> str:
    """ "0.820 (90% ± 6%)": the accuracy, the share of the source's above chance kept, ± its items' standard error."""
    got, want = metrics.get(f"eval/{shots}shot/{task}/{metric}"), source.get(f"eval/{shots}shot/{task}/{metric}")
    if got is None or want is None:
        return "-"
    if want <= CHANCE:  # nothing above chance to keep
        return f"{got:.3f} (source at chance)"
    se = math.sqrt(got * (1 - got) / n) / (want - CHANCE)
    return f"{got:.3f} ({(got - CHANCE) / (want - CHANCE):.0%} ± {se:.0%})"


def cell(value) -> str:
    """A fault record's value as a table cell."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1e}" if 0 < abs(value) < 1e-3 else f"{value:g}"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items())
    return str(value)


def faults_table(payload: dict) -> str:
    """The fault-injection suite's trials (tests/test_faults.py with T6_FAULTS_OUT): a summary, then one row each."""
    records = payload["trials"]
    env = payload["environment"]
    seeded = [r for r in records if r["trial"].startswith("w")]
    two, four = (sum(r["world"] == world for r in seeded) for world in (2, 4))
    phases = Counter(p for r in seeded for p in r["landed"])
    signals = Counter(s for r in seeded for s in r["signals"].values())
    versions = ", ".join(f"{name} {env[name]}" for name in ("torch", "lightning", "mlflow", "submitit") if name in env)
    summary = (
        f"*{env['machine']}; {versions}; {env['date']}.*\n\n"
        f"{len(records)} trials ({len(seeded)} seeded signal trials: {two} on 2 ranks, {four} on 4); hung "
        f"{sum(r['hung'] for r in records)}; MLflow runs per trial {sorted({r['mlflow_runs'] for r in records})}; "
        "signals landed during "
        + ", ".join(f"{k} {v}" for k, v in sorted(phases.items()))
        + "; the signals that landed: "
        + ", ".join(f"{k} {v}" for k, v in sorted(signals.items()))
        + "."
    )
    columns = [
        ("trial", "trial"),
        ("world", "ranks"),
        ("signals", "signal per rank"),
        ("landed", "landed during"),
        ("agreed", "agreed"),
        ("stop_step", "stop step"),
        ("checkpoint_step", "checkpoint step"),
        ("steps_lost", "steps lost"),
        ("exit_codes", "exit codes"),
        ("max_rel_loss_delta", "max rel. loss delta"),
        ("mlflow_runs", "MLflow runs"),
        ("stop_s", "s to stop"),
        ("hung", "hung"),
    ]
    rows = [[cell(r.get(key)) for key, _ in columns] for r in records]
    return summary + "\n\n" + markdown([title for _, title in columns], rows)


def faults_sigterm_table(payload: dict) -> str:
    """SIGTERM to every rank of a torchrun job (experiments/faults/sigterm_all_ranks.py), at one commit."""
    exits = [r["exit_s"] for r in payload["results"] if r["exit_s"] is not None]
    codes = sorted({c for r in payload["results"] for c in (r.get("worker_codes") or [])})
    header = ["code", "trials", "hung (no exit within the timeout)", "last.ckpt saved at the stop", "worker exit codes"]
    header.append("seconds to exit")
    row = [
        f"{payload['name']} ({payload['commit']})",
        str(payload["trials"]),
        str(payload["hung"]),
        str(payload["saved_on_stop"]),
        cell(codes) if codes else "-",
        f"{min(exits)}-{max(exits)}" if exits else "-",
    ]
    return f"*{payload['machine']}; a hang: no exit within {payload['timeout_s']:g} s.*\n\n" + markdown(header, [row])


def columns_table(payload: dict, columns: list[tuple[str, str, Callable]], note: str = "") -> str:
    """The caption, a note, and one row per record: columns (key, header, format), a cell empty where the record
    lacks the key."""
    header = [h for _, h, _ in columns]
    rows = [["" if r.get(key) is None else fmt(r[key]) for key, _, fmt in columns] for r in payload["records"]]
    return f"{caption(payload)}{' ' + note if note else ''}\n\n{markdown(header, rows)}"


def num(spec: str) -> Callable:
    return lambda v: format(v, spec)


def text(v) -> str:
    return str(v)


def suite_table(payload: dict) -> str:
    """The suite's stages: their outcome and time."""
    cols = [("stage", "stage", text), ("what", "what", text), ("status", "outcome", text), ("seconds", "s", num(".0f"))]
    return columns_table(payload, cols, f"Budget {payload['budget_s']:.0f} s; each stage's output in logs/.")


def machine_table(payload: dict) -> str:
    cols = [
        ("device", "device", text),
        ("cpu", "CPU", text),
        ("copy_bandwidth_gbs", "copy GB/s (read + write)", num(".1f")),
        ("matmul_tflops_float32", "fp32 matmul TFLOP/s", num(".2f")),
        ("matmul_tflops_bfloat16", "bf16 matmul TFLOP/s", num(".2f")),
        ("torch", "torch", text),
        ("triton", "triton", text),
        ("lightning", "lightning", text),
        ("liger_kernel", "liger-kernel", text),
    ]
    return columns_table(payload, cols)


def tests_table(payload: dict) -> str:
    cols = [(k, k, text) for k in ("tests", "passed", "skipped", "failures", "errors")] + [("failed", "failed", text)]
    return columns_table(payload, cols, f"`pytest {payload['selection']}`.")


def decode_kernels_table(payload: dict) -> str:
    cols = [
        ("attention", "attention", text),
        ("kernel", "operator", text),
        ("dtype", "dtype", text),
        ("batch", "batch", text),
        ("context", "context", k),
        ("us", "us/step", num(".1f")),
        ("gpu_us", "GPU us", num(".1f")),
        ("host_us", "host us", num(".1f")),
        ("of_copy_bw", "of copy bandwidth", num(".2f")),
        ("max_abs_err", "max error", num(".1e")),
        ("within_tolerance", "within tolerance", text),
    ]
    note = f"Copy bandwidth {payload['copy_bandwidth_gbs']:.1f} GB/s; size {payload['size']}."
    return columns_table(payload, cols, note)


def generate_table(payload: dict) -> str:
    cols = [
        ("attention", "attention", text),
        ("prompt", "prompt", k),
        ("batch", "batch", text),
        ("step", "decoder", text),
        ("kernel", "attention kernel", text),
        ("graph", "CUDA graph", text),
        ("prefill_ms", "prefill ms", num(".1f")),
        ("ms_per_token", "ms/step", num(".3f")),
        ("tokens_per_s", "tokens/s", num(",.0f")),
        ("bound_tokens_per_s", "bound tokens/s", num(",.0f")),
        ("fraction_of_bound", "of bound", num(".3f")),
    ]
    cols = [c for c in cols if c[0] not in ("kernel", "graph") or any(c[0] in r for r in payload["records"])]
    return columns_table(payload, cols, f"Size {payload['size']}, {payload['dtype']}.")


def step_overhead_table(payload: dict) -> str:
    cols = [
        ("attention", "attention", text),
        ("batch", "batch", text),
        ("context", "context", text),
        ("graph_inputs", "graph inputs", text),
        ("guards_us", "compiled step: guards us", num(".1f")),
        ("eager_us", "eager step us", num(".1f")),
        ("replay_us", "graph replay us", num(".1f")),
    ]
    note = f"Host time per decode step, size {payload['size']} (off CUDA the replay runs nothing)."
    return columns_table(payload, cols, note)


def headline_table(payload: dict) -> str:
    cols = [
        ("attention", "attention", text),
        ("size", "size", text),
        ("precision", "precision", text),
        ("compile", "compile", text),
        ("compile_s", "compile s", num(".1f")),
        ("compile_cache", "compile cache", text),
        ("compile_warm_s", "compile s, warm cache", num(".1f")),
        ("step_s", "step s", num(".3f")),
        ("tokens_per_s", "tokens/s", num(",.0f")),
        ("mfu", "MFU", num(".1%")),
        ("checkpoint_stall_s", "checkpoint stall s", num(".2f")),
        ("checkpoint_stall_ratio", "stall / median step", num(".0%")),
        ("eval_s", "evaluation s", num(".1f")),
        ("samples_s", "samples s", num(".1f")),
        ("closing_s", "after training s", num(".1f")),
        ("training_share", "training share of wall", num(".0%")),
        ("fallbacks", "fell back", text),
    ]
    r = payload["records"][0]
    note = f"{r['steps']} steps of micro-batch {r['micro_batch']} x {r['seq_len']}; {r['eval_items']} evaluation items."
    return columns_table(payload, cols, note)


def kernel_fit_table(payload: dict) -> str:
    cols = [
        ("kernel", "kernel", text),
        ("dtype", "dtype", text),
        ("heads_padded", "heads", text),
        ("width_padded", "width", text),
        ("tuning", "block/warps/stages", text),
        ("shared_bytes", "shared memory B", num(",")),
        ("registers", "registers", text),
        ("spill_bytes", "spilled B", text),
        ("fits", f"fits {payload['target']}", text),
        ("used_by", "mechanism/size", text),
    ]
    return columns_table(payload, cols, f"Compiled ahead of time for {payload['target']}; nothing ran.")


def fusion_table(payload: dict) -> str:
    cols = [
        ("attention", "attention", text),
        ("n_head", "heads", text),
        ("forward_kernels", "forward: kernels", text),
        ("forward_library_calls", "library calls", text),
        ("forward_kernel_bytes_per_token", "kernels' B/token", num(",.0f")),
        ("forward_library_bytes_per_token", "library calls' B/token", num(",.0f")),
        ("backward_kernels", "backward: kernels", text),
        ("backward_library_calls", "library calls", text),
        ("backward_kernel_bytes_per_token", "kernels' B/token", num(",.0f")),
        ("backward_library_bytes_per_token", "library calls' B/token", num(",.0f")),
    ]
    note = (
        f"One attention layer at {payload['size']}, {payload['dtype']}, batch {payload['batch_size']} x "
        f"{payload['seq_len']}: inductor's graphs scheduled for Triton; nothing ran."
    )
    return columns_table(payload, cols, note)


def test_durations_table(payload: dict) -> str:
    """The test suite's time: the run, each file (slowest first), the slowest tests."""
    wall = f"{payload['wall_s'] / 60:.1f} min for the command" if payload.get("wall_s") else "wall time not recorded"
    counts = ", ".join(f"{n} {k}" for k, n in sorted(payload["outcomes"].items()))
    workers = payload.get("workers", 1)
    over = f", added up over {workers} pytest-xdist workers" if workers > 1 else ""
    head = f"{caption(payload)} {wall}; {payload['tests_s'] / 60:.1f} min in the tests themselves{over} ({counts})."
    if payload.get("note"):
        head += f" {payload['note']}"
    files = markdown(
        ["file", "tests", "s", "share"],
        [
            [f["file"], str(f["tests"]), f"{f['seconds']:.0f}", f"{f['seconds'] / payload['tests_s']:.0%}"]
            for f in payload["files"]
        ],
    )
    tests = markdown(
        ["slowest tests", "s"], [[f"{r['file']}::{r['test']}", f"{r['seconds']:.1f}"] for r in payload["records"]]
    )
    return f"{head}\n\n{files}\n\n{tests}"


# The GPU recipe's budget (conf/experiment/paper_small.yaml, paper_medium.yaml: 480 x 1024 tokens x 100k steps) and
# the share of an H100's dense bf16 peak a step is assumed to reach (t6.run.plan.ASSUMED_MFU).
PAPER_TOKENS = 480 * 1024 * 100_000
H100_BF16 = 989e12
ASSUMED_MFU = 0.4


def matched_sizes_table(payload: dict) -> str:
    """experiments/matched/sizes.json: per size, each mechanism under each match criterion: its query heads and the
    sizes that moved, parameters, KV bytes and training FLOPs per token; at the GPU recipe's sizes, the H100 hours
    of one run of the paper's budget and of a tenth of it."""
    records, env = payload["records"], payload["environment"]
    parts = [f"*Solved and counted on the meta device: Python {env['python']}, torch {env['torch']}; {env['date']}.*"]
    for size in dict.fromkeys(r["size"] for r in records):
        rows, hours = [], {}
        for r in (r for r in records if r["size"] == size):
            moved = ", ".join(f"{k} {a}->{b}" for k, (a, b) in r["changed"].items() if k != "n_head") or "-"
            run_h = r["train_flops_per_token"] * PAPER_TOKENS / (H100_BF16 * ASSUMED_MFU) / 3600
            hours[r["criterion"]] = hours.get(r["criterion"], 0.0) + run_h
            rows.append([
                r["attention"], r["criterion"], str(r["n_head"]), moved, f"{r['params'] / 1e6:.2f}M",
                f"{r['kv_bytes_per_token']:,}", f"{r['train_flops_per_token'] / 1e9:.3f}", f"{r['gap']:+.2%}",
                f"{run_h:,.0f}" if size != "tiny" else "-",
            ])  # fmt: skip
        header = ["attention", "match", "heads", "other sizes moved", "params", "KV B/token", "train GFLOP/token"]
        header += ["gap to MHA", "H100 h / run (49.2B tokens)"]
        parts += [f"**{size}**", markdown(header, rows)]
        if size != "tiny":
            total = sum(hours.values())
            parts.append(
                f"{size}: one seed of every row {total:,.0f} H100 hours at the paper's 49.2B tokens (x 3 seeds: "
                f"{3 * total:,.0f}); at 10k steps (4.92B tokens) {total / 10:,.0f} (x 3 seeds: {3 * total / 10:,.0f})."
            )
    return "\n\n".join(parts)


RENDERERS: dict[str, Callable[[dict], str]] = {
    "suite": suite_table,
    "machine": machine_table,
    "tests": tests_table,
    "decode_kernels": decode_kernels_table,
    "generate": generate_table,
    "step_overhead": step_overhead_table,
    "headline": headline_table,
    "kernel_fit": kernel_fit_table,
    "fusion": fusion_table,
    "decode": decode_table,
    "prefill": prefill_table,
    "kv_memory": kv_memory_table,
    "train_step": train_step_table,
    "memory": memory_table,
    "export": export_table,
    "pretrained": pretrained_table,
    "matched_sizes": matched_sizes_table,
    "faults": faults_table,
    "faults_sigterm": faults_sigterm_table,
    "test_durations": test_durations_table,
}


def render(readme: Path) -> str:
    """The README with every declared table rendered from its JSON."""

    def table(match: re.Match) -> str:
        path = readme.parent / match["file"]
        if not path.is_file():
            raise FileNotFoundError(f"{readme}: its table names {match['file']}, which does not exist beside it")
        payload = json.loads(path.read_text())
        kind = payload.get("benchmark")
        if kind not in RENDERERS:
            raise ValueError(f"{path}: benchmark {kind!r} has no table layout (known: {sorted(RENDERERS)})")
        return f"{match[1]}{RENDERERS[kind](payload)}\n{match[4]}"

    return MARKER.sub(table, readme.read_text())


def readmes(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("README.md") if MARKER.search(p.read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path("experiments"), help="where the studies are")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a table is stale")
    args = parser.parse_args(argv)
    stale = []
    for readme in readmes(args.root):
        text = render(readme)
        if text != readme.read_text():
            stale.append(readme)
            if not args.check:
                readme.write_text(text)
                print(f"rewrote the tables of {readme}")
    if args.check and stale:
        print(
            "tables that differ from their JSON (python -m t6.report.experiments rewrites them): "
            + ", ".join(map(str, stale)),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
