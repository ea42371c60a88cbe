"""Throughput of the lm-eval adapter on multiple-choice items: items/s with each choice's context
run again (share_prefix=False, the per-choice path) and with one prefill of the context shared by
the four choices (the default), measured side by side on the same model and items.

Two tasks, both built from the embedded corpus (nothing downloaded): the local next-line task
(3 lines of context, 0 and 2 shots), and a HellaSwag-shaped one with long contexts (the same
items with `--long-context-lines` lines of context, 0 shots: a long passage, four one-line endings).

    python -m t6.bench.eval_items [--size tiny] [--attention tpa] [--items 40] [--threads N] [--json PATH]
    python -m t6.bench.eval_items --device cuda --dtype bfloat16 --size medium --items 200

The model has random weights at `--size`, in `--dtype`, on `--device` (auto: CUDA where there is one).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import t6.hydra_config
from t6.bench import harness
from t6.bench.common import compose
from t6.bench.harness import DTYPES, environment, resolve_device
from t6.evaluation.adapter import T6LM
from t6.evaluation.next_line import build_next_line_task
from t6.model import T6


def model_for(size: str, attention: str) -> T6:
    cfg = compose("train", [f"size={size}", f"attention={attention}"])
    torch.manual_seed(0)
    return T6(t6.hydra_config.model_config(cfg)).eval()


def requests(task_dir: Path, n_items: int, shots: int) -> list[SimpleNamespace]:
    """The loglikelihood requests lm-eval makes for n_items: (prompt, "\\n" + choice) x 4 choices."""
    items = [json.loads(x) for x in (task_dir / "test.jsonl").read_text().splitlines()][:n_items]
    few = [json.loads(x) for x in (task_dir / "fewshot.jsonl").read_text().splitlines()][:shots]
    prefix = "".join(f"{f['passage']}\n{f['choices'][f['label']]}\n\n" for f in few)
    return [SimpleNamespace(args=(prefix + it["passage"], "\n" + c)) for it in items for c in it["choices"]]


def mean_tokens(lm: T6LM, reqs: list) -> tuple[float, float]:
    """Mean (context, continuation) tokens of the requests, as lm-eval splits a causal model's pair: the whole
    text encoded, the context's tokens first, the rest the continuation's."""
    context = [len(lm.tok_encode(c)) for c, _ in (r.args for r in reqs)]
    whole = [len(lm.tok_encode(c + k)) for c, k in (r.args for r in reqs)]
    return sum(context) / len(reqs), (sum(whole) - sum(context)) / len(reqs)


def measure(lms: list[T6LM], reqs: list, n_items: int, repeats: int) -> list[float]:
    """Items/s of each adapter: the best of `repeats` runs, taken in turns so that a busy spell
    of a shared machine slows every adapter alike."""
    best = [float("inf")] * len(lms)
    for _ in range(repeats):
        for i, lm in enumerate(lms):
            start = time.perf_counter()
            lm.loglikelihood(reqs, disable_tqdm=True)
            best[i] = min(best[i], time.perf_counter() - start)
    return [n_items / b for b in best]


COLUMNS = [
    ("size", "size", ""),
    ("attention", "attention", ""),
    ("task", "task", ""),
    ("shots", "shots", "d"),
    ("context_tokens", "ctx tokens", ".1f"),
    ("continuation_tokens", "cont tokens", ".1f"),
    ("items_per_s_per_choice", "per-choice items/s", ".2f"),
    ("items_per_s_shared_prefix", "shared-prefix items/s", ".2f"),
    ("speedup", "ratio", ".2f"),
]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = harness.parser(__doc__)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--attention", default="tpa")
    parser.add_argument("--items", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--task-dir", default="data/eval/t6_next_line")
    parser.add_argument("--long-task-dir", default="data/eval/t6_next_line_long")
    parser.add_argument("--long-context-lines", type=int, default=12)
    parser.add_argument("--device", type=resolve_device, default="auto", help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="the model's weights")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--json", type=Path, default=None, help="write the records to this JSON file")
    args = harness.parse(parser, argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: no CUDA device here; use --device cpu (or auto)")

    task_dir = build_next_line_task(args.task_dir)
    long_dir = build_next_line_task(args.long_task_dir, context_lines=args.long_context_lines)
    model = model_for(args.size, args.attention).to(device=args.device, dtype=DTYPES[args.dtype])
    device = environment(args.device)["device"]  # the GPU's name on CUDA
    per_choice = T6LM(model=model, batch_size=args.batch_size, share_prefix=False)
    shared = T6LM(model=model, batch_size=args.batch_size)
    rows = []
    for task, folder, shots in (("next_line", task_dir, 0), ("next_line", task_dir, 2), ("long", long_dir, 0)):
        reqs = requests(folder, args.items, shots)
        ctx, cont = mean_tokens(shared, reqs)
        before, after = measure([per_choice, shared], reqs, args.items, args.repeats)
        rows.append(
            {
                "size": args.size,
                "attention": args.attention,
                "task": task,
                "shots": shots,
                "items": args.items,
                "context_tokens": round(ctx, 1),
                "continuation_tokens": round(cont, 1),
                "device": device,
                "dtype": args.dtype,
                "threads": torch.get_num_threads(),
                "batch_size": args.batch_size,
                "items_per_s_per_choice": round(before, 2),
                "items_per_s_shared_prefix": round(after, 2),
                "speedup": round(after / before, 2),
            }
        )
    harness.finish(harness.result("eval_items", args.device, rows), COLUMNS, args.json)
    return rows


if __name__ == "__main__":
    main()
