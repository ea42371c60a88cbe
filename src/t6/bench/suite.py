"""One command measures a machine: the project's benchmarks as stages, most important first, within a time budget.

    python -m t6.bench.suite                       # a GPU: ~8 minutes (--budget-s 480)
    python -m t6.bench.suite --smoke               # every stage at tiny shapes on the CPU, in under 3 minutes
    python -m t6.bench.suite --stages generate,headline --out experiments/<machine>   # again, some stages
    python -m t6.bench.suite --stages generate --attentions all                      # every mechanism

Each stage runs in its own process with its own timeout (`Stage.timeout_s`, less where the budget has less left)
and writes its JSON into the output folder as it measures; the suite appends the stage's outcome to `suite.json`
as soon as it ends. A stage that fails, hangs or runs out of time costs only itself: the next one starts. A stage
starts only while the budget has `MIN_START_S` left. At the end the folder's README.md holds a table per stage,
rendered from the JSON by t6.report.experiments (as every measured table), naming the machine and versions.

The stages on CUDA (medium, bf16):

1. machine: the device, versions, copy bandwidth, matmul peak (t6.bench.machine);
2. cuda_tests: the tests that need a GPU (`pytest -m cuda`), their outcome;
3. kernels: each fused decode operator against its eager reference, fp32 and bf16, 4k and 32k cached tokens,
   batch 1 and 16, with GPU time and copy-bandwidth fraction (t6.bench.decode_kernels);
4. generate: tokens/s of whole-model generation of the paper's six mechanisms (`--attentions` names others),
   2k prompt, batch 1 and 16, against the bound of reading the weights and caches once per step
   (t6.bench.generate);
5. decode: one layer's step at 32k and 128k cached tokens, with its GPU time, of the paper's six, GTA and GLA
   (or `--attentions`) (t6.bench.decode);
6. host: the host's time per step, dynamo's guards against a graph replay (t6.bench.step_overhead);
7. train_eager, train_compiled: the training step of MHA and TPA, eager, and of MHA, TPA, TPA-KVonly, MLA and GLA
   compiled, with MFU against MHA's and the compiled step's costliest kernels (t6.bench.train_step);
8. train_contract: the compiled step of MHA and TPA with TPA's contraction through t6::tpa_contract's Triton
   kernels, to set against train_compiled's TPA (t6.bench.train_step --triton-contract);
9. headline: `train.py attention=tpa size=medium` shrunk: compile time, tokens/s, MFU, checkpoint stall,
   evaluation time (t6.bench.headline).

`--smoke` runs the same stages at tiny shapes on the CPU (its compiled step through aot_eager, no code
generation), which is how the tests run the command itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

from t6.bench import harness

DEFAULT_BUDGET_S = 480  # 8 minutes: one command on a GPU lent for 15 minutes, its start and a rerun included
SMOKE_BUDGET_S = 180
MIN_START_S = 20  # a stage starts only with this much budget left
ROOT = Path(__file__).resolve().parents[3]  # the checkout: tests/ for the CUDA-only tests
CUDA_TEST_FILES = (
    "tests/test_fused_decode.py",
    "tests/test_static_decode.py",
    "tests/test_bench.py",
    "tests/test_evaluation.py",
    "tests/test_resume.py",
)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the stages' commands read: where they write, the device, and whether this is the smoke run."""

    out: Path
    device: str
    smoke: bool
    timeout_scale: float = 1.0  # every stage's timeout times this (a slower or busier machine)
    attentions: str | None = None  # the mechanisms of the generate and decode stages (None: each stage's own)
    python: str = sys.executable

    def json(self, stage: str) -> Path:
        return self.out / f"{stage}.json"

    def machine(self) -> dict:
        """The machine stage's record, once it has run (the bandwidth and peak the decode stage's roofline reads)."""
        path = self.json("machine")
        return json.loads(path.read_text())["records"][0] if path.is_file() else {}


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    what: str
    timeout_s: float  # on a GPU
    smoke_timeout_s: float
    command: Callable[[Settings], list[str]]  # the process to run

    def timeout(self, settings: Settings) -> float:
        return settings.timeout_scale * (self.smoke_timeout_s if settings.smoke else self.timeout_s)


def bench(module: str, settings: Settings, stage: str, *args: str) -> list[str]:
    return [settings.python, "-m", f"t6.bench.{module}", *args, "--json", str(settings.json(stage))]


def machine(s: Settings) -> list[str]:
    return bench("machine", s, "machine", "--device", s.device)


def cuda_tests(s: Settings) -> list[str]:
    xml = s.out / "cuda_tests.xml"
    return [s.python, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"] + [
        str(ROOT / f) for f in CUDA_TEST_FILES
    ]


def kernels(s: Settings) -> list[str]:
    if s.smoke:
        shape = ("--attentions", "tpa,mla", "--size", "tiny", "--contexts", "64", "--batches", "1", "--steps", "2")
    else:
        shape = ("--size", "medium", "--contexts", "4k,32k", "--batches", "1,16", "--steps", "20")
    return bench("decode_kernels", s, "kernels", "--device", s.device, "--dtypes", "float32,bfloat16", *shape)


def generate(s: Settings) -> list[str]:
    if s.smoke:
        shape = ("--size", "tiny", "--prompt-lengths", "32", "--batches", "1", "--new-tokens", "16", "--rounds", "1")
        names = s.attentions or "mha,tpa"
        return bench(
            "generate", s, "generate", "--attentions", names, "--device", s.device, "--dtype", "float32", *shape
        )
    shape = ("--size", "medium", "--prompt-lengths", "2k", "--batches", "1,16", "--new-tokens", "64", "--rounds", "2")
    names = s.attentions or "paper"
    return bench("generate", s, "generate", "--attentions", names, "--device", s.device, "--dtype", "bfloat16", *shape)


def decode(s: Settings) -> list[str]:
    m = s.machine()
    limits = []
    if m and not s.device == "cpu":
        limits = ["--bandwidth-gbs", str(m["copy_bandwidth_gbs"]), "--peak-tflops", str(m["matmul_tflops_bfloat16"])]
    if s.smoke:
        shape = ("--size", "tiny", "--contexts", "128", "--steps", "2", "--rounds", "1", "--warmup", "1")
        return bench(
            "decode", s, "decode", "--attentions", s.attentions or "mha,tpa", "--device", s.device, *shape, *limits
        )
    shape = ("--size", "medium", "--contexts", "32k,128k", "--steps", "10", "--rounds", "3", "--dtype", "bfloat16")
    names = s.attentions or "paper,gta,gla"
    return bench("decode", s, "decode", "--attentions", names, "--device", s.device, *shape, *limits)


def host(s: Settings) -> list[str]:
    size = (
        ("--size", "tiny", "--dtype", "float32", "--steps", "5", "--rounds", "2") if s.smoke else ("--size", "medium")
    )
    return bench("step_overhead", s, "host", "--attentions", "mha,tpa", "--device", s.device, *size)


def train_step(compiled: bool, triton_contract: bool = False) -> Callable[[Settings], list[str]]:
    def command(s: Settings) -> list[str]:
        stage = "train_contract" if triton_contract else "train_compiled" if compiled else "train_eager"
        # compiled: every mechanism with a target against MHA's MFU (TPA 0.95x; TPA-KVonly, MLA, GLA 0.9x)
        attentions = "mha,tpa,tpa_kvonly,mla,gla" if compiled and not s.smoke else "mha,tpa"
        if triton_contract:  # TPA's contraction through t6::tpa_contract's kernels, against MHA in the same run
            attentions = "mha,tpa"
        args = ["--attentions", attentions, "--device", s.device]
        if s.smoke:
            args += ["--size", "tiny", "--batch-size", "2", "--seq-len", "32", "--steps", "2", "--warmup", "1"]
            args += ["--dtype", "float32", "--override", "size.n_layer=1"]
        else:
            args += ["--size", "medium", "--batch-size", "16", "--steps", "5", "--warmup", "2", "--dtype", "bfloat16"]
        if compiled:
            args += ["--compile", "--compile-backend", "aot_eager" if s.smoke else "inductor"]
            args += ["--profile-top", "15"]  # the compiled step's kernels by time, per mechanism (in its JSON)
        if triton_contract:
            args += ["--triton-contract"]
        return bench("train_step", s, stage, *args)

    return command


def headline(s: Settings) -> list[str]:
    if s.smoke:
        return bench(
            "headline", s, "headline", "--size", "tiny", "--steps", "4", "--eval-limit", "4", "--samples-tokens", "4"
        )
    return bench("headline", s, "headline")


# Each stage's timeout on a GPU is about twice what it took on an H200 (torch 2.11, 2026-11-28), where that run
# completed it: machine 5 s, cuda_tests 40 s, kernels 23 s, generate ~9 s per mechanism (s4: 13 mechanisms in
# 114 s; the paper's six ~60 s with the process's start), decode 15 s, train_eager 32 s, train_compiled 45 s,
# headline 115 s; host failed there after 14 s (its cache overflowed), ~20 s expected. The stages' expected
# times add up to ~360 s, within the default budget's 480 s; a stage that runs to its timeout costs the
# stages after it their share.
STAGES = [
    Stage("machine", "device, versions, copy bandwidth, matmul peak", 30, 30, machine),
    Stage("cuda_tests", "the tests that need a GPU", 90, 60, cuda_tests),
    Stage("kernels", "fused decode operators against their reference, fp32 and bf16", 60, 30, kernels),
    Stage("generate", "whole-model generation per mechanism against its bound", 120, 40, generate),
    Stage("decode", "one layer's decode step at 32k and 128k", 45, 30, decode),
    Stage("host", "the host's time per decode step", 45, 40, host),
    Stage("train_eager", "the training step, eager", 60, 30, train_step(False)),
    Stage("train_compiled", "the training step, compiled", 160, 40, train_step(True)),
    Stage("train_contract", "the compiled step, TPA's contraction by t6::tpa_contract", 70, 40, train_step(True, True)),
    Stage("headline", "the headline run, shrunk", 180, 90, headline),
]
BY_NAME = {stage.name: stage for stage in STAGES}


def tests_record(xml: Path) -> dict:
    """A pytest JUnit XML report as the cuda_tests stage's record: counts and the failures' names."""
    suite = ET.parse(xml).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": ", ".join(failed) or "none", "seconds": float(suite.get("time", 0))}


def run_stage(stage: Stage, settings: Settings, timeout: float) -> dict:
    """Run one stage's process (its output in logs/<stage>.log) -> its outcome: ok, failed (exit code), timeout."""
    log = settings.out / "logs" / f"{stage.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    command = stage.command(settings)
    env = dict(os.environ)
    if settings.smoke:  # tiny shapes: one thread each, so a busy machine's cores are not oversubscribed
        env["OMP_NUM_THREADS"] = "1"
    start = time.perf_counter()
    with open(log, "w") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        try:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT, env=env)
            status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
        except subprocess.TimeoutExpired:
            status = f"timeout ({timeout:.0f} s)"
    seconds = time.perf_counter() - start
    if stage.name == "cuda_tests":  # pytest's outcome is the stage's record
        xml = settings.out / "cuda_tests.xml"
        if xml.is_file():
            record = tests_record(xml)
            result = harness.result("tests", settings.device, [record], selection="-m cuda")
            harness.write_json(settings.json("cuda_tests"), result, quiet=True)
            xml.unlink()
            if status.startswith("failed") and record["failures"] + record["errors"] == 0:
                status = "ok"  # exit 5: nothing selected ran (every test skipped off CUDA)
    return {"stage": stage.name, "what": stage.what, "status": status, "seconds": seconds, "log": str(log.name)}


def machine_slug(device: str) -> str:
    """A folder name for this machine: the GPU's name, else the CPU's, lower case, dashes."""
    name = harness.environment(device)["device"] if device.startswith("cuda") else harness.machine_name()
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


README = """# {title}

`python -m t6.bench.suite{flags}` on {machine}, {date}: each stage's table rendered from the JSON beside this
file by `python -m t6.report.experiments`{smoke}.

"""


def write_readme(settings: Settings, outcomes: list[dict]) -> Path:
    """README.md in the output folder: the stages' outcomes, then each stage's table, rendered from its JSON (by
    `python -m t6.report.experiments`, as every measured table)."""
    env = harness.environment(settings.device)
    smoke = (
        " (tiny shapes on a CPU: a check that every stage runs, not a measurement of a GPU)" if settings.smoke else ""
    )
    text = README.format(
        title=f"The benchmark suite on {env['device'] if settings.device != 'cpu' else env['machine']}",
        flags=" --smoke" if settings.smoke else "",
        machine=env["machine"] if settings.device == "cpu" else env["device"],
        date=env["date"],
        smoke=smoke,
    )
    text += "## Stages\n\n<!-- table: suite.json -->\n<!-- end table -->\n"
    for outcome in outcomes:
        path = settings.json(outcome["stage"])
        if path.is_file():
            text += f"\n## {outcome['stage']}: {outcome['what']}\n\n<!-- table: {path.name} -->\n<!-- end table -->\n"
    readme = settings.out / "README.md"
    readme.write_text(text)
    subprocess.run([settings.python, "-m", "t6.report.experiments", "--root", str(settings.out)], check=True)
    return readme


def run(settings: Settings, stages: list[Stage], budget_s: float) -> list[dict]:
    """Every stage in order, within the budget; suite.json rewritten as each ends. Returns the outcomes."""
    settings.out.mkdir(parents=True, exist_ok=True)
    outcomes: list[dict] = []
    start = time.perf_counter()
    for stage in stages:
        left = budget_s - (time.perf_counter() - start)
        if left < MIN_START_S:
            outcome = {"stage": stage.name, "what": stage.what, "status": "skipped (budget spent)", "seconds": 0.0}
        else:
            print(f"[suite] {stage.name}: {stage.what} (up to {min(stage.timeout(settings), left):.0f} s)", flush=True)
            outcome = run_stage(stage, settings, min(stage.timeout(settings), left))
        outcomes.append(outcome)
        print(f"[suite] {stage.name}: {outcome['status']} in {outcome['seconds']:.1f} s", flush=True)
        summary = harness.result("suite", settings.device, outcomes, smoke=settings.smoke, budget_s=budget_s)
        harness.write_json(settings.json("suite"), summary, quiet=True)
    return outcomes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = harness.parser(__doc__)
    parser.add_argument("--smoke", action="store_true", help="every stage at tiny shapes on the CPU")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"seconds for all stages (default {DEFAULT_BUDGET_S}, smoke {SMOKE_BUDGET_S})",
    )
    parser.add_argument(
        "--stages", default=None, help=f"a subset, comma-separated, in this order: {', '.join(BY_NAME)}"
    )
    parser.add_argument("--device", type=harness.resolve_device, default="auto", help="auto, cpu, cuda (smoke: cpu)")
    parser.add_argument("--out", type=Path, default=None, help="the output folder (default experiments/<machine>)")
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="every stage's timeout times this")
    parser.add_argument(
        "--attentions",
        type=harness.attention_names,
        default=None,
        help="the mechanisms the generate and decode stages measure (default: generate the paper's six, decode "
        "those, GTA and GLA); names, `paper`, `all`, comma-separated",
    )
    args = parser.parse_args(argv)
    names = args.stages.split(",") if args.stages else list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"--stages: {', '.join(unknown)} unknown; the stages are {', '.join(BY_NAME)}")
    args.stages = [stage for stage in STAGES if stage.name in names]
    if args.smoke:
        args.device = "cpu"
    if args.budget_s is None:
        args.budget_s = SMOKE_BUDGET_S if args.smoke else DEFAULT_BUDGET_S
    if args.out is None:
        args.out = ROOT / "experiments" / (machine_slug(args.device) + ("-smoke" if args.smoke else ""))
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    attentions = ",".join(args.attentions) if args.attentions else None
    settings = Settings(args.out, args.device, args.smoke, args.timeout_scale, attentions)
    outcomes = run(settings, args.stages, args.budget_s)
    readme = write_readme(settings, outcomes)
    print(harness.table(outcomes, COLUMNS))
    print(f"[suite] tables: {readme}")
    return outcomes


COLUMNS = [("stage", "stage", ""), ("status", "status", ""), ("seconds", "seconds", ".1f"), ("what", "what", "")]


if __name__ == "__main__":
    main()
