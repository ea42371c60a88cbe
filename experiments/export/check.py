"""One trained T6 through both lm-eval routes, side by side, and through both generators.

    python experiments/export/check.py --ckpt logs/train/runs/<time>/checkpoints/last.ckpt [--out /tmp/t6-tiny]

1. `python export.py ckpt_path=CKPT out=OUT` writes the Hugging Face directory (and checks its logits);
2. the project's route: `python -m t6.evaluation --model t6 --model_args checkpoint=CKPT`;
3. the standard route: `lm_eval --model hf --model_args pretrained=OUT,trust_remote_code=True,logits_cache=False`,
   offline, and the same with lm-eval's default logits_cache=True (which misreads some requests when two tasks
   share text: docs/export.md);
   all on the local tasks training built (data/eval), 0- and 2-shot, beside the numbers the training run
   logged at its end (its closing summary), read from MLflow;
4. greedy generation of the run's sample prompts: transformers' generate() on OUT against T6.generate,
   one prompt at a time and left-padded in one batch.
Writes check.json next to this file. Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TASKS = ("t6_next_line", "t6_cloze")
SHOTS = (0, 2)
METRICS = ("acc", "acc_norm")
PROMPTS = ["ROMEO:", "JULIET:", "First Citizen:"]  # conf/train.yaml's samples.prompts


def timed(cmd: list[str], env: dict | None = None) -> float:
    """Run a command from the repository root, failing loudly; returns its wall time in seconds."""
    start = time.perf_counter()
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, **(env or {})})
    return time.perf_counter() - start


def lm_eval_results(folder: Path) -> dict:
    (path,) = folder.rglob("results_*.json")
    return json.loads(path.read_text())["results"]


ROUTES = {  # name -> (lm-eval model, its model_args given the checkpoint and the export directory)
    "t6": ("t6", "checkpoint={ckpt}"),
    "hf": ("hf", "pretrained={out},trust_remote_code=True,logits_cache=False"),
    "hf_logits_cache": ("hf", "pretrained={out},trust_remote_code=True"),
}


def evaluate(route: str, model_args: str, shots: int, out_dir: Path, bin_dir: Path) -> tuple[dict, float, list[str]]:
    """lm-eval through ROUTES[route] -> (results, seconds, command)."""
    folder = out_dir / f"{route}_{shots}shot"
    model = ROUTES[route][0]
    head = [sys.executable, "-m", "t6.evaluation"] if model == "t6" else [str(bin_dir / "lm_eval")]
    cmd = [
        *head,
        *("--model", model, "--model_args", model_args, "--tasks", ",".join(TASKS)),
        *("--include_path", "data/eval", "--num_fewshot", str(shots), "--batch_size", "16", "--device", "cpu"),
        *("--output_path", str(folder)),
    ]
    seconds = timed(cmd, {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    return lm_eval_results(folder), seconds, cmd


def generation(ckpt: Path, out: Path, max_new_tokens: int = 40) -> dict:
    """Greedy continuations of PROMPTS by T6.generate and by transformers' generate(), alone and batched."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from t6.data.tokenizer import EOT, gpt2_encoding
    from t6.model.load import load_model
    from t6.model.t6 import left_pad

    model, enc = load_model(ckpt), gpt2_encoding()
    hf, tokenizer = (
        AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True),
        AutoTokenizer.from_pretrained(out, trust_remote_code=True),
    )
    t6_rows, hf_rows = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([enc.encode(prompt)])  # [1, T0]
            t6_rows.append(model.generate(ids, max_new_tokens, temperature=0, stop_tokens=(EOT,))[0].tolist())
            hf_rows.append(
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens)[0].tolist()
            )
        idx, mask = left_pad([enc.encode(p) for p in PROMPTS], pad_id=EOT)
        t6_batch = model.generate(idx, max_new_tokens, temperature=0, stop_tokens=(EOT,), prompt_mask=mask)
        hf_batch = hf.generate(idx, attention_mask=mask.long(), max_new_tokens=max_new_tokens)
    return {
        "max_new_tokens": max_new_tokens,
        "tokenizer_equal": [tokenizer(p)["input_ids"] for p in PROMPTS] == [enc.encode(p) for p in PROMPTS],
        "tokens_equal": t6_rows == hf_rows,
        "batched_tokens_equal": bool(t6_batch.shape == hf_batch.shape and torch.equal(t6_batch, hf_batch)),
        "t6": [enc.decode(row) for row in t6_rows],
        "transformers": [tokenizer.decode(row) for row in hf_rows],
    }


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())  # fmt: skip
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "system": platform.platform()}


def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("torch", "transformers", "tokenizers", "safetensors", "lm_eval", "accelerate")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, type=Path, help="the training run's checkpoints/last.ckpt")
    parser.add_argument("--out", default=Path("/tmp/t6-tiny"), type=Path, help="the export directory")
    parser.add_argument("--tracking-uri", default=f"sqlite:///{ROOT / 'mlruns' / 'mlflow.db'}")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from t6.hf.export import run_record
    from t6.model.load import read_checkpoint

    work = Path("/tmp") / f"t6-export-check-{os.getpid()}"
    bin_dir = Path(sys.executable).parent
    export_cmd = [sys.executable, "export.py", f"ckpt_path={args.ckpt}", f"out={args.out}"]
    seconds = {"export": timed(export_cmd + [f"tracking_uri={args.tracking_uri}"])}
    run_id = read_checkpoint(args.ckpt, mmap=True).get("mlflow_run_id")
    run_metrics, origin = run_record(run_id, args.tracking_uri)
    table, commands = [], {"export": export_cmd}
    for shots in SHOTS:
        results = {}
        for route, (_, args_template) in ROUTES.items():
            model_args = args_template.format(ckpt=args.ckpt, out=args.out)
            name = f"{route}_{shots}shot"
            results[route], seconds[name], commands[name] = evaluate(route, model_args, shots, work, bin_dir)
        for task in TASKS:
            for metric in METRICS:
                row = {"task": task, "shots": shots, "metric": metric}
                row["run"] = run_metrics.get(f"eval/{shots}shot/{task}/{metric}")
                row.update({route: results[route][task][f"{metric},none"] for route in ROUTES})
                table.append(row)
    start = time.perf_counter()
    gen = generation(args.ckpt, args.out)
    seconds["generation"] = time.perf_counter() - start
    report = {
        "benchmark": "export",  # the layout of its table in t6.report.experiments
        "date": date.today().isoformat(),
        "machine": machine(),
        "versions": versions(),
        "checkpoint": str(args.ckpt),
        "mlflow": origin,
        "commands": commands,
        "table": table,
        "routes_equal": all(abs(r["t6"] - r["hf"]) < 1e-9 for r in table),
        "run_equal": all(r["run"] is not None and abs(r["run"] - r["hf"]) < 1e-9 for r in table),
        "generation": gen,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
    }
    path = Path(__file__).with_name("check.json")
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("routes_equal", "run_equal", "seconds")}, indent=2))
    for r in table:
        routes = "  ".join(f"{route} {r[route]:.4f}" for route in ROUTES)
        print(f"{r['task']:14s} {r['shots']}-shot {r['metric']:9s} run {r['run']:.4f}  {routes}")
    print(f"greedy tokens equal: {gen['tokens_equal']} (batched: {gen['batched_tokens_equal']}); wrote {path}")


if __name__ == "__main__":
    main()
