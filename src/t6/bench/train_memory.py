"""The memory preflight's estimate beside the measured peak of real training steps.

Each case runs `t6.run.train.main` in a fresh subprocess (the real Trainer, model, optimizer and
data; no logger, checkpoints or downstream evaluation) for a few optimizer steps at a fixed
micro-batch without accumulation, then reports the preflight's estimate and the measured peak:
CPU peak RSS (VmHWM, the process's own high-water mark), or on a GPU the caching allocator's peak
`torch.cuda.max_memory_reserved`: what the step takes out of the free memory the preflight budgets
(`mem_get_info`, read after the CUDA context exists), fragmentation included; the peak of live
tensors (`max_memory_allocated`) is reported beside it.

    python -m t6.bench.train_memory --case tiny:8 --case small:1 --case medium:1
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from t6.bench import harness

GIB = 2**30


def measure(size: str, batch: int, attention: str = "tpa", steps: int = 2, extra: tuple[str, ...] = ()) -> dict:
    """In this process: train `steps` steps and return the estimate and the measured peak (bytes)."""
    import torch
    from omegaconf import open_dict

    from t6.bench.common import compose
    from t6.hardware.probes import peak_rss
    from t6.run.train import main as train

    out = Path(tempfile.mkdtemp(prefix="t6-bench-memory-"))
    overrides = [
        f"size={size}",
        f"attention={attention}",
        f"data.batch_size={batch}",
        f"data.global_batch_size={batch}",
        f"trainer.max_steps={steps}",
        "trainer.limit_val_batches=1",
        "eval=none",
        "logger=none",
        "callbacks.model_checkpoint=null",
        "callbacks.rich_model_summary=null",
        "print_config=false",
        "auto_resume=false",
        *extra,
    ]
    cfg = compose("train", overrides, runtime=True)
    with open_dict(cfg):
        cfg.paths.output_dir = str(out)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        _, objects = train(cfg)
    finally:
        shutil.rmtree(out, ignore_errors=True)  # the run's files (GBs at medium) are not what is measured
    plan = objects["plan"]
    estimate = plan.batch.memory.estimate
    result = {
        "size": size,
        "batch": batch,
        "attention": attention,
        "precision": plan.hardware.precision,
        "device": plan.hardware.device,
        "estimate": estimate.total,
        "components": {
            k: getattr(estimate, k)
            for k in ("runtime", "params", "grads", "optimizer", "activations", "loss_transient")
        },
    }
    if plan.hardware.device == "cuda":
        result["measured"] = torch.cuda.max_memory_reserved()
        result["allocated"] = torch.cuda.max_memory_allocated()
        result["measure"] = f"torch.cuda.max_memory_reserved (tensors: {result['allocated'] / GIB:.2f}G allocated)"
    else:
        result["measured"] = peak_rss()
        result["measure"] = "peak RSS (VmHWM)"
    result["ratio"] = result["estimate"] / result["measured"]
    return result


def run_case(size: str, batch: int, attention: str = "tpa", extra: tuple[str, ...] = ()) -> dict:
    """measure() in a fresh Python process, so each peak is that case's alone."""
    cmd = [
        sys.executable,
        "-m",
        "t6.bench.train_memory",
        "--child",
        f"{size}:{batch}",
        "--attention",
        attention,
        *[f"--extra={e}" for e in extra],
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", default=[], help="SIZE:MICRO_BATCH, repeatable (default tiny:8)")
    parser.add_argument("--attention", default="tpa")
    parser.add_argument("--extra", action="append", default=[], help="more config overrides")
    parser.add_argument("--json", type=Path, help="write the records to this JSON file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        size, batch = args.child.split(":")
        print(json.dumps(measure(size, int(batch), args.attention, extra=tuple(args.extra))))
        return
    print(
        f"{'size':<8}{'micro-batch':>12}{'precision':>11}{'estimate':>11}{'measured':>11}{'est/meas':>10}  measured as"
    )
    records = []
    for case in args.case or ["tiny:8"]:
        size, batch = case.split(":")
        r = run_case(size, int(batch), args.attention, tuple(args.extra))
        records.append(r)
        print(
            f"{r['size']:<8}{r['batch']:>12}{r['precision']:>11}"
            f"{r['estimate'] / GIB:>10.2f}G{r['measured'] / GIB:>10.2f}G"
            f"{r['ratio']:>10.2f}  {r['measure']}",
            flush=True,
        )
    device = records[0]["device"] if records else "cpu"
    harness.write_json(args.json, harness.result("memory", device, records, extra=list(args.extra)))


if __name__ == "__main__":
    main()
