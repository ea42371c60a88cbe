"""Throughput of the lm-eval adapter on the embedded next-line task: items/s, batched vs one
request at a time, measured side by side on the same model and items.

    python -m t6.bench.eval_items [--size tiny] [--attention tpa] [--items 40] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from hydra import compose, initialize_config_dir

import t6.config
from t6.evaluation.adapter import T6LM
from t6.evaluation.next_line import build_next_line_task
from t6.model import T6

CONF = t6.config.conf_dir()


def model_for(size: str, attention: str) -> T6:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"size={size}", f"attention={attention}"])
    torch.manual_seed(0)
    return T6(t6.config.model_config(cfg)).eval()


def requests(task_dir: Path, n_items: int, shots: int) -> list[SimpleNamespace]:
    """The loglikelihood requests lm-eval makes for n_items: (prompt, "\\n" + choice) x 4 choices."""
    items = [json.loads(x) for x in (task_dir / "test.jsonl").read_text().splitlines()][:n_items]
    few = [json.loads(x) for x in (task_dir / "fewshot.jsonl").read_text().splitlines()][:shots]
    prefix = "".join(f"{f['passage']}\n{f['choices'][f['label']]}\n\n" for f in few)
    return [SimpleNamespace(args=(prefix + it["passage"], "\n" + c)) for it in items for c in it["choices"]]


def measure(lm: T6LM, reqs: list, n_items: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        lm.loglikelihood(reqs, disable_tqdm=True)
        best = min(best, time.perf_counter() - start)
    return n_items / best


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--attention", default="tpa")
    parser.add_argument("--items", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--task-dir", default="data/eval/t6_next_line")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)

    task_dir = build_next_line_task(args.task_dir)
    model = model_for(args.size, args.attention)
    rows = []
    for shots in (0, 2):
        reqs = requests(task_dir, args.items, shots)
        one = measure(T6LM(model=model, batch_size=1), reqs, args.items, args.repeats)
        batched = measure(T6LM(model=model, batch_size=args.batch_size), reqs, args.items, args.repeats)
        rows.append({
            "size": args.size, "attention": args.attention, "shots": shots, "items": args.items,
            "device": "cpu", "threads": torch.get_num_threads(), "batch_size": args.batch_size,
            "items_per_s_one_at_a_time": round(one, 2), "items_per_s_batched": round(batched, 2),
            "speedup": round(batched / one, 2),
        })
    print(f"{'size':6s} {'attention':9s} {'shots':>5s} {'one-at-a-time items/s':>22s} {'batched items/s':>16s} {'ratio':>6s}")
    for r in rows:
        print(f"{r['size']:6s} {r['attention']:9s} {r['shots']:5d} {r['items_per_s_one_at_a_time']:22.2f} "
              f"{r['items_per_s_batched']:16.2f} {r['speedup']:6.2f}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
