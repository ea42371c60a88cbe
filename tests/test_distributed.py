"""`python train.py` as users run it, in subprocesses: 2-process CPU DDP and FSDP (gloo) as single
runs, DDP inside a 2-job multirun and under torchrun, a sweep's MLflow parent and child runs, and a
real SIGTERM to a training process followed by a resume. Slow: each starts Lightning (and DDP / FSDP
start it twice)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import mlflow
import pytest
import torch

from t6.evaluation.callback import EvalSettings, build_eval_callback
from t6.evaluation.runner import flat_metrics, run_harness
from t6.model.load import load_model

from conftest import ROOT, TEST_RUN, TEST_SIZE, seed_store

pytestmark = pytest.mark.slow
DDP = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]
FSDP = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]


class NaNOnRank(L.Callback):
    """Makes one rank's training loss NaN in the micro-batches of optimizer step `step` (loaded by the
    training processes through +callbacks.nan._target_=test_distributed.NaNOnRank)."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank, self.handle = step, rank, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and trainer.global_rank == self.rank and self.handle is None:
            self.handle = pl_module.model.embed.register_forward_hook(lambda m, args, out: out * float("nan"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.handle is not None and trainer.global_step != self.step:
            self.handle.remove()
            self.handle = None


class ComputeDtypes(L.Callback):
    """At the first training step, the dtype of the weight each module type holds in its forward and of what it
    returns, written to `path` by rank 0 (loaded through +callbacks.dtypes._target_=test_distributed.ComputeDtypes)."""

    def __init__(self, path: str):
        self.path, self.seen, self.handles = Path(path), {}, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 0 and not self.handles:
            for module in pl_module.model.modules():
                if getattr(module, "weight", None) is not None:
                    self.handles.append(module.register_forward_hook(self.record))

    def record(self, module, args, out):
        out = out[0] if isinstance(out, tuple) else out
        self.seen.setdefault(type(module).__name__, [str(module.weight.dtype), str(out.dtype)])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for handle in self.handles:
            handle.remove()
        if trainer.global_rank == 0 and self.seen and not self.path.exists():
            self.path.write_text(json.dumps(self.seen))


def command(tmp_path: Path, data_dir: Path, *overrides: str) -> tuple[list[str], dict]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(
        T6_ROOT=str(tmp_path),
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]),
        MLFLOW_ENABLE_ASYNC_LOGGING="false",
    )
    flags = [o for o in overrides if o.startswith("-")]  # -m goes before the overrides
    rest = [o for o in overrides if not o.startswith("-")]
    if not any(o.startswith("eval") for o in rest):
        rest.insert(0, "eval=none")  # downstream evaluation only where a test asks for it
    args = [sys.executable, str(ROOT / "train.py"), *flags, *TEST_SIZE, *TEST_RUN, f"paths.data_dir={data_dir}", *rest]
    return args, env


def run(tmp_path: Path, data_dir: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """train.py in a process of its own, which must succeed; its MLflow store under tmp_path made already."""
    seed_store(tmp_path / "mlruns" / "mlflow.db")
    args, env = command(tmp_path, data_dir, *overrides)
    proc = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def client(tmp_path: Path) -> mlflow.MlflowClient:
    return mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns/mlflow.db")


def all_runs(c: mlflow.MlflowClient):
    return c.search_runs([e.experiment_id for e in c.search_experiments()])


def step_of(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


def recorder(path: Path) -> list[str]:
    """Overrides adding tests/fault_worker.Recorder: each rank's loss per optimizer step in path/loss<rank>.json."""
    return ["+callbacks.rec._target_=fault_worker.Recorder", f"+callbacks.rec.path='{path}/loss{{rank}}.json'"]


def test_ddp_two_processes_run_and_resume_exactly(tmp_path, shared_data_dir):
    first = tmp_path / "first"
    run(
        tmp_path,
        shared_data_dir,
        *DDP,
        "data.batch_size=2",
        "data.global_batch_size=8",  # 2 ranks x 2 x accumulate 2
        "callbacks.model_checkpoint.save_top_k=-1",
        f"hydra.run.dir={first}",
        *recorder(first),
    )
    assert step_of(first / "checkpoints" / "last.ckpt") == 8
    (run_,) = all_runs(client(tmp_path))  # ranks 1.. log nothing of their own
    resumed = tmp_path / "resumed"
    run(
        tmp_path,
        shared_data_dir,
        *DDP,
        "data.batch_size=2",
        "data.global_batch_size=8",
        f"ckpt_path={first / 'checkpoints' / 'step000004.ckpt'}",
        f"hydra.run.dir={resumed}",
        *recorder(resumed),
    )
    assert step_of(resumed / "checkpoints" / "last.ckpt") == 8
    (again,) = all_runs(client(tmp_path))  # the resumed run logged into the same MLflow run
    assert again.info.run_id == run_.info.run_id and again.data.tags["redone_steps"] == "5-8"
    history: dict[int, list[float]] = {}
    for m in client(tmp_path).get_metric_history(run_.info.run_id, "train/loss"):
        history.setdefault(m.step, []).append(m.value)
    assert history.keys() == set(range(8)) and all(len(v) == 1 for v in history.values())  # redone steps once
    for rank in range(2):  # the resumed steps 5-8 on each rank: the uninterrupted run's losses
        before, after = (json.loads((d / f"loss{rank}.json").read_text()) for d in (first, resumed))
        assert sorted(after, key=int) == ["4", "5", "6", "7", "8"]  # "4": step 5's first micro-batch (accumulation)
        for step, loss in after.items():
            assert loss == pytest.approx(before[step], abs=1e-6), (rank, step)


def history(c: mlflow.MlflowClient, run_id: str, key: str) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for m in sorted(c.get_metric_history(run_id, key), key=lambda m: m.timestamp):
        out.setdefault(m.step, []).append(m.value)
    return out


def test_fsdp_trains_clips_skips_evaluates_and_resumes_like_ddp(tmp_path, shared_data_dir, make_cfg):
    """The same 6 steps under DDP and FSDP (2 CPU processes each): clipping by the global norm, a
    NaN loss on rank 1 at step 4 skipped on both ranks, weight decay on the matrices and the
    embedding only, a downstream evaluation every 3 steps; then FSDP resumed from step 3. DDP's
    evaluation splits the 9 documents between the ranks (5 and 4, padded) and scores as one process does."""
    common = [
        "data.batch_size=2",
        "data.global_batch_size=8",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "trainer.gradient_clip_val=0.5",
        "callbacks.model_checkpoint.every_n_train_steps=3",
        "callbacks.model_checkpoint.save_top_k=-1",
        "nonfinite_loss=skip",
        "+callbacks.nan._target_=test_distributed.NaNOnRank",
        "+callbacks.nan.step=4",
        "+callbacks.nan.rank=1",
        "eval=local",
        "eval.limit=9",
        "eval.num_fewshot=[0]",
        "eval.every_n_steps=3",
    ]
    dirs = {name: tmp_path / name for name in ("ddp", "fsdp", "resumed")}
    run(tmp_path, shared_data_dir, *DDP, *common, "experiment_name=ddp", f"hydra.run.dir={dirs['ddp']}")
    run(tmp_path, shared_data_dir, *FSDP, *common, "experiment_name=fsdp", f"hydra.run.dir={dirs['fsdp']}")
    run(  # resumed from step 3 as an MLflow run of its own, its curves beside the uninterrupted run's
        tmp_path,
        shared_data_dir,
        *FSDP,
        *common,
        "experiment_name=fsdp-resumed",
        "logger.mlflow.continue_run=false",
        f"hydra.run.dir={dirs['resumed']}",
        f"ckpt_path={dirs['fsdp'] / 'checkpoints' / 'step000003.ckpt'}",
    )

    c = client(tmp_path)
    (ddp,) = c.search_runs([c.get_experiment_by_name("ddp").experiment_id])
    (fsdp,) = c.search_runs([c.get_experiment_by_name("fsdp").experiment_id])
    (resumed,) = c.search_runs([c.get_experiment_by_name("fsdp-resumed").experiment_id])
    ddp_loss, fsdp_loss = history(c, ddp.info.run_id, "train/loss"), history(c, fsdp.info.run_id, "train/loss")
    assert sorted(ddp_loss) == sorted(fsdp_loss) == list(range(6))
    for step in range(6):
        assert fsdp_loss[step][0] == pytest.approx(ddp_loss[step][0], rel=1e-5), step
    resumed_loss = history(c, resumed.info.run_id, "train/loss")
    assert sorted(resumed_loss) == [3, 4, 5]
    for step in range(3, 6):  # resumed from step 3: the uninterrupted run's losses
        assert resumed_loss[step][0] == pytest.approx(fsdp_loss[step][0], abs=1e-6), step
    ddp_norm, fsdp_norm = (
        history(c, ddp.info.run_id, "train/grad_norm"),
        history(c, fsdp.info.run_id, "train/grad_norm"),
    )
    assert sorted(ddp_norm) == sorted(fsdp_norm) == list(range(6))
    assert math.isnan(ddp_norm[4][0]) and all(
        math.isnan(v) for v in fsdp_norm[4]
    )  # step 4: NaN on rank 1 only, skipped
    assert max(v[0] for v in fsdp_norm.values()) > 0.5  # clipping acted
    for step in (0, 1, 2, 3, 5):  # the global norm, not one shard's
        assert fsdp_norm[step][0] == pytest.approx(ddp_norm[step][0], rel=1e-3), step  # a shard's would be ~30% off
    key = "eval/0shot/t6_next_line/acc_norm"
    for run_ in (fsdp, resumed):  # uninterrupted and resumed
        assert history(c, run_.info.run_id, "train/skipped_steps")[4] == [1.0]
        assert history(c, run_.info.run_id, key)[6] == history(c, ddp.info.run_id, key)[6]

    # DDP's evaluations: logged once each (rank 0), not again at the end, training going on after the first; the
    # step-6 weights scored by one process over all 9 documents give the same numbers
    assert {step: len(v) for step, v in history(c, ddp.info.run_id, key).items()} == {3: 1, 6: 1}
    callback = build_eval_callback(
        EvalSettings.read(make_cfg("eval=local", "eval.limit=9", "eval.num_fewshot=[0]").eval)
    )
    model = load_model(dirs["ddp"] / "checkpoints" / "last.ckpt", device="cpu")
    single = flat_metrics(run_harness(model, callback.spec, callback.task_manager), callback.spec)
    for name in ("eval/0shot/t6_next_line/acc", key):
        assert history(c, ddp.info.run_id, name)[6] == [pytest.approx(single[name], abs=1e-9)], name

    last = {name: torch.load(d / "checkpoints" / "last.ckpt", weights_only=True) for name, d in dirs.items()}
    assert all(ck["global_step"] == 6 for ck in last.values())
    groups = {
        name: [(g["kind"], g["weight_decay"], len(g["params"])) for g in ck["optimizer_states"][0]["param_groups"]]
        for name, ck in last.items()
    }
    assert groups["fsdp"] == groups["ddp"] == groups["resumed"]
    assert [(kind, wd) for kind, wd, _ in groups["fsdp"]] == [("matrix", 0.1), ("embedding", 0.1), ("norm", 0.0)]
    # Adam's moments keyed alike (the index of a parameter in the optimizer's groups), so either run resumes the other
    ddp_state, fsdp_state = (last[name]["optimizer_states"][0]["state"] for name in ("ddp", "fsdp"))
    assert sorted(ddp_state) == sorted(fsdp_state)
    for i, moments in ddp_state.items():
        torch.testing.assert_close(fsdp_state[i]["exp_avg"], moments["exp_avg"], rtol=1e-3, atol=1e-6, msg=str(i))
    for name in ("fsdp", "resumed"):  # whole tensors, the same values (up to summation order, which Adam's
        for key, ref in last["ddp"]["state_dict"].items():  # normalized step amplifies where a gradient is ~0)
            torch.testing.assert_close(last[name]["state_dict"][key], ref, rtol=1e-4, atol=5e-5, msg=f"{name} {key}")


def test_fsdp_bf16_mixed_computes_as_ddp_does(tmp_path, shared_data_dir):
    """bf16-mixed: FSDP keeps fp32 parameters (gathered, reduced and updated in fp32) and autocasts the matmuls,
    as DDP does; the two train alike to bf16's precision (Lightning's FSDP precision would compute every module
    from bf16 weights)."""
    common = [
        "trainer.precision=bf16-mixed",
        "data.batch_size=2",
        "data.global_batch_size=8",
        "trainer.max_steps=6",
        "callbacks.model_checkpoint.every_n_train_steps=3",
        "+callbacks.dtypes._target_=test_distributed.ComputeDtypes",
        "samples=null",
    ]
    for name, strategy in (("ddp", DDP), ("fsdp", FSDP)):
        run(
            tmp_path,
            shared_data_dir,
            *strategy,
            *common,
            f"+callbacks.dtypes.path={tmp_path / name}.json",
            f"experiment_name={name}",
            f"hydra.run.dir={tmp_path / name}",
        )
    ddp, fsdp = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("ddp", "fsdp"))
    assert fsdp == ddp and ddp["Linear"] == ["torch.float32", "torch.bfloat16"]  # fp32 weights, bf16 matmuls
    c = client(tmp_path)
    (ddp_run,) = c.search_runs([c.get_experiment_by_name("ddp").experiment_id])
    (fsdp_run,) = c.search_runs([c.get_experiment_by_name("fsdp").experiment_id])
    ddp_loss, fsdp_loss = history(c, ddp_run.info.run_id, "train/loss"), history(c, fsdp_run.info.run_id, "train/loss")
    assert sorted(ddp_loss) == sorted(fsdp_loss) == list(range(6))
    for step in range(6):  # bf16 keeps 8 significant bits: 2^-8 relative
        assert fsdp_loss[step][0] == pytest.approx(ddp_loss[step][0], rel=2**-8), step
    ddp_last, fsdp_last = (
        torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=True) for name in ("ddp", "fsdp")
    )
    for key, ref in ddp_last["state_dict"].items():  # fp32 master weights, the same to bf16's precision (as a
        weights = fsdp_last["state_dict"][key]  # whole: Adam's normalized step can flip single entries by ~lr)
        assert weights.dtype == torch.float32 and torch.linalg.norm(weights - ref) <= 2**-8 * torch.linalg.norm(ref), (
            key
        )


def test_torchrun_launched_ddp_trains_and_resumes(tmp_path, shared_data_dir):
    """torch.distributed.run starts both ranks (as on a cluster); Lightning joins its process group. Each
    rank plans its micro-batch alone (batch_size=auto), and the ranks compare plans at setup."""

    def torchrun(*overrides: str) -> None:
        auto = ("data.batch_size=auto", "data.global_batch_size=8")
        args, env = command(tmp_path, shared_data_dir, *DDP, *auto, *overrides)
        args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args[1:]]
        proc = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    run_dir = tmp_path / "run"
    torchrun("trainer.max_steps=4", f"hydra.run.dir={run_dir}")
    assert step_of(run_dir / "checkpoints" / "last.ckpt") == 4
    torchrun("trainer.max_steps=6", "auto_resume=true", f"hydra.run.dir={run_dir}")  # the same job, requeued
    assert step_of(run_dir / "checkpoints" / "last.ckpt") == 6
    (run_,) = all_runs(client(tmp_path))  # one MLflow run: rank 1 logged nothing, the resume continued it
    assert sorted(history(client(tmp_path), run_.info.run_id, "train/loss")) == list(range(6))


def test_ddp_inside_a_multirun_runs_each_job_once(tmp_path, shared_data_dir):
    sweep = tmp_path / "sweep"
    run(tmp_path, shared_data_dir, "-m", "attention=mha,tpa", *DDP, f"hydra.sweep.dir={sweep}")
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    for job in ("0", "1"):
        assert step_of(sweep / job / "checkpoints" / "last.ckpt") == 8
    assert not (tmp_path / "logs").exists()  # no child re-ran the sweep into a default sweep dir
    c = client(tmp_path)
    runs = all_runs(c)
    assert len(runs) == 3  # one parent, one child per job, nothing from the DDP children
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.data.tags["override.attention"] for r in children) == ["mha", "tpa"]
    assert {r.data.tags["sweep.params"] for r in children} == {"attention=mha", "attention=tpa"}
    assert {r.info.run_name for r in children} == {"attention=mha", "attention=tpa"}
    assert parent.info.status == "FINISHED"
    assert all(r.info.status == "FINISHED" and "train/loss" in r.data.metrics for r in children)
    assert c.get_experiment(parent.info.experiment_id).name == "t6-sweep-sweep"


def test_a_sweep_of_jobs_at_once_has_one_parent_and_a_child_per_job(tmp_path, shared_data_dir):
    """Hydra's joblib launcher runs the jobs at once, in processes of its own (Hydra's basic launcher, one job
    after the other, is the multirun above)."""
    run(
        tmp_path,
        shared_data_dir,
        "-m",
        "attention=mha,tpa",
        "hydra.callbacks.mlflow_sweep.experiment_name=my-study",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
    )
    c = client(tmp_path)
    experiment = c.get_experiment_by_name("my-study")
    runs = c.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(runs) == 3 and len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert {r.data.tags["sweep.params"] for r in children} == {"attention=mha", "attention=tpa"}
    assert {r.info.run_name for r in children} == {"attention=mha", "attention=tpa"}
    assert all(r.info.status == "FINISHED" and "train/loss" in r.data.metrics for r in children)


def test_sigterm_saves_a_checkpoint_and_the_rerun_resumes(tmp_path, shared_data_dir):
    run_dir = tmp_path / "job"
    overrides = [
        "trainer.max_steps=100000",
        "auto_resume=true",
        "callbacks.model_checkpoint.every_n_train_steps=2",
        f"hydra.run.dir={run_dir}",
    ]
    args, env = command(tmp_path, shared_data_dir, *overrides)
    proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not list((run_dir / "checkpoints").glob("step*.ckpt")):  # training is under way
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-3000:]
    assert "last.ckpt saved" in stderr and "Traceback" not in stderr
    saved = step_of(run_dir / "checkpoints" / "last.ckpt")
    assert saved >= 2
    (killed,) = all_runs(client(tmp_path))
    assert killed.info.status == "KILLED"

    rerun = run(
        tmp_path, shared_data_dir, *overrides[1:], f"trainer.max_steps={saved + 2}"
    )  # same run dir: auto-resume
    assert "Restoring states from the checkpoint path at" in rerun.stdout + rerun.stderr
    assert step_of(run_dir / "checkpoints" / "last.ckpt") == saved + 2
    (resumed,) = all_runs(client(tmp_path))
    assert resumed.info.run_id == killed.info.run_id and resumed.info.status == "FINISHED"
