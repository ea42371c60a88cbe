"""Exact resume, preemption (a real SIGTERM), non-finite losses and safe checkpoint files, in-process on CPU."""

from __future__ import annotations

import os
import pickle
import signal
from pathlib import Path

import lightning as L
import mlflow
import pytest
import torch
from omegaconf import open_dict

from t6.run.closing import closing_summary
from t6.run.train import main as train
from t6.training.checkpoint_io import AtomicCheckpointIO
from t6.training.fsdp import T6FSDPStrategy
from t6.training.stop import STOP_SIGNALS, RunStopped, StopProtocol


class Recorder(L.Callback):
    """Per optimizer step: the loss, and one draw from torch's RNG (as dropout would make)."""

    def __init__(self):
        self.loss, self.draw = {}, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.loss[trainer.global_step] = outputs["loss"].item()
        self.draw[trainer.global_step] = torch.rand(1).item()


class SigtermAt(L.Callback):
    """Sends this process a real SIGTERM after optimizer step `step` (the run stops at the end of the next one,
    where the ranks agree on it)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class NaNAt(L.Callback):
    """Makes the model's output NaN for the training batch of optimizer step `step` only."""

    def __init__(self, step: int):
        self.step, self.handle = step, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.handle = pl_module.model.register_forward_hook(lambda m, args, out: out * float("nan"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def in_dir(cfg, run_dir: Path, *callbacks: str):
    """The config with its run directory at run_dir and the given test callbacks (name=target) added."""
    with open_dict(cfg):
        cfg.paths.output_dir = str(run_dir)
        for spec in callbacks:
            name, target = spec.split("=")
            cfg.callbacks[name] = {
                "_target_": target.split("(")[0],
                **({"step": int(target.split("(")[1][:-1])} if "(" in target else {}),
            }
    return cfg


def recorder(objects) -> Recorder:
    return next(cb for cb in objects["trainer"].callbacks if isinstance(cb, Recorder))


@pytest.fixture
def stopped():
    """`main` ends a stop as the process does: it hands the signal over (the stop signals ignored from then on, exit
    128 + signum). Yields a check of that exit; the signals' handlers are put back afterwards."""
    saved = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}

    def check(exit_: pytest.ExceptionInfo, signum: int = signal.SIGTERM) -> None:
        assert exit_.value.code == 128 + signum and isinstance(exit_.value.__context__, RunStopped)

    yield check
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.mark.slow  # three training runs (~6 s)
def test_sigterm_then_auto_resume_matches_an_uninterrupted_run(make_cfg, tmp_path, monkeypatch, stopped):
    _, full = train(in_dir(make_cfg(), tmp_path / "full", "rec=test_resume.Recorder"))
    full_rec = recorder(full)

    run_dir = tmp_path / "preempted"
    agreements, agree = [], StopProtocol.agree  # the protocol's own all_reduce: T6LitModule's check carries it
    monkeypatch.setattr(StopProtocol, "agree", lambda self, trainer: agreements.append(trainer.global_step) or 0)
    with pytest.raises(SystemExit) as exit_:
        train(in_dir(make_cfg(), run_dir, "rec=test_resume.Recorder", "term=test_resume.SigtermAt(4)"))
    stopped(exit_)
    assert agreements == []
    last = run_dir / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 5  # saved by the SIGTERM path, not a periodic checkpoint (every 4 steps)
    client = mlflow.MlflowClient(tracking_uri=make_cfg().logger.mlflow.tracking_uri)
    run_id = ckpt["mlflow_run_id"]
    assert client.get_run(run_id).info.status == "KILLED"

    monkeypatch.setattr(StopProtocol, "agree", agree)
    _, resumed = train(in_dir(make_cfg("auto_resume=true"), run_dir, "rec=test_resume.Recorder"))  # same run dir
    rec = recorder(resumed)
    assert resumed["trainer"].global_step == 8 and sorted(rec.loss) == [6, 7, 8]
    for step in rec.loss:
        assert rec.loss[step] == full_rec.loss[step], step  # bitwise: same weights, optimizer, data, schedule
        assert rec.draw[step] == full_rec.draw[step], step  # RNG continues where it stopped
    assert resumed["mlflow"].run_id == run_id and client.get_run(run_id).info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run_id, "train/loss")]
    assert sorted(set(steps)) == list(range(8))


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(make_cfg, tmp_path):
    cfg = in_dir(make_cfg("trainer.max_steps=8"), tmp_path / "nan", "nan=test_resume.NaNAt(5)")
    with pytest.raises(
        FloatingPointError,
        match=r"non-finite gradient norm \(nan.*at step 5.*last good checkpoint is kept: .*last.ckpt",
    ):
        train(cfg)
    ckpt = torch.load(tmp_path / "nan" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 4
    assert all(torch.isfinite(t).all() for t in ckpt["state_dict"].values())
    client = mlflow.MlflowClient(tracking_uri=cfg.logger.mlflow.tracking_uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FAILED" and run.data.tags["last_step"] == "5"  # report.py reads how far it got
    assert run.data.tags["error"].startswith("Diverged: non-finite gradient norm (nan")


class Weights(L.Callback):
    """A copy of the model's weights after every optimizer step."""

    def __init__(self):
        self.after = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]


def test_nonfinite_loss_skip_makes_no_update_and_goes_on(make_cfg, tmp_path):
    cfg = in_dir(
        make_cfg("nonfinite_loss=skip"),
        tmp_path / "skip",
        "nan=test_resume.NaNAt(5)",
        "rec=test_resume.Recorder",
        "w=test_resume.Weights",
    )
    metrics, objects = train(cfg)
    assert objects["model"].skipped_steps == 1
    losses = recorder(objects).loss
    assert sorted(losses) == list(range(1, 9)) and torch.isnan(
        torch.tensor(losses[6])
    )  # step 5's loss, recorded after it
    assert all(torch.isfinite(torch.tensor(v)) for s, v in losses.items() if s != 6)
    weights = next(cb for cb in objects["trainer"].callbacks if isinstance(cb, Weights)).after
    assert all(torch.equal(a, b) for a, b in zip(weights[5], weights[6]))  # step 5 made no update
    assert not all(torch.equal(a, b) for a, b in zip(weights[6], weights[7]))  # step 6 did
    assert all(torch.isfinite(p).all() for p in objects["model"].parameters())
    assert torch.isfinite(torch.tensor(metrics["val/loss"]))


class Payload:
    """Pickled, it runs code on load (what weights_only loading must refuse)."""

    def __reduce__(self):
        return (Path.touch, (Path(os.environ["T6_PAYLOAD_MARKER"]),))


def test_checkpoints_never_run_pickled_code(make_cfg, tmp_path, monkeypatch):
    _, first = train(in_dir(make_cfg("trainer.max_steps=4"), tmp_path / "a"))
    assert isinstance(first["trainer"].strategy.checkpoint_io.checkpoint_io, AtomicCheckpointIO)
    folder = tmp_path / "a" / "checkpoints"
    assert os.path.samefile(folder / "last.ckpt", folder / "step000004.ckpt")  # one write, two names (a hard link)
    ckpt = torch.load(folder / "last.ckpt", weights_only=True)
    marker = tmp_path / "pwned"
    monkeypatch.setenv("T6_PAYLOAD_MARKER", str(marker))
    ckpt["payload"] = Payload()
    evil = tmp_path / "evil.ckpt"
    torch.save(ckpt, evil)
    with pytest.raises(pickle.UnpicklingError):
        train(in_dir(make_cfg("trainer.max_steps=6", f"ckpt_path={evil}"), tmp_path / "b"))
    with pytest.raises(pickle.UnpicklingError):  # Lightning's own resume path reads through the same plugin
        first["trainer"].strategy.checkpoint_io.load_checkpoint(evil)
    with pytest.raises(pickle.UnpicklingError):  # FSDP bypasses the plugin; its strategy reads the same way
        T6FSDPStrategy().load_checkpoint(evil)
    assert not marker.exists()


def test_resume_maps_the_checkpoint_instead_of_copying_it(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(4)}}, path)
    calls, load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: calls.append(kw) or load(*a, **kw))
    AtomicCheckpointIO().load_checkpoint(path)
    with pytest.raises(AttributeError):  # reads the file, then needs the wrapped model it does not have here
        T6FSDPStrategy().load_checkpoint(path)
    assert [(kw["weights_only"], kw["mmap"]) for kw in calls] == [(True, True), (True, True)]


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("disk full")  # a failure half-way through writing


def test_checkpoint_write_is_atomic(tmp_path):
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"step": torch.tensor(1), "blob": torch.zeros(1000)}, path)
    before = path.read_bytes()
    with pytest.raises(RuntimeError, match="disk full"):
        io.save_checkpoint({"blob": torch.ones(1000), "bad": Unpicklable()}, path)
    assert path.read_bytes() == before and list(tmp_path.iterdir()) == [path]
    assert io.load_checkpoint(path)["step"] == 1


def test_run_ends_with_validation_and_exactly_one_last_ckpt(make_cfg):
    cfg = make_cfg("trainer.max_steps=6", "trainer.val_check_interval=4")  # neither interval falls on step 6
    metrics, objects = train(cfg)
    client = mlflow.MlflowClient(tracking_uri=cfg.logger.mlflow.tracking_uri)
    run_id = objects["mlflow"].run_id
    assert [m.step for m in client.get_metric_history(run_id, "val/loss")] == [3, 5]  # step 4 and the final step 6
    ckpt_dir = Path(objects["trainer"].checkpoint_callback.dirpath)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["last.ckpt", "step000004.ckpt"]
    assert torch.load(ckpt_dir / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 6
    text = closing_summary(metrics, objects)
    assert f"final val/loss {metrics['val/loss']:.4f}" in text and f"checkpoint      {ckpt_dir / 'last.ckpt'}" in text
    assert "warmup 10 of 6 steps" in text

    _, again = train(make_cfg("trainer.max_steps=9", "ckpt_path=last"))  # resume in the same run dir
    assert [p.name for p in ckpt_dir.iterdir() if p.name.startswith("last")] == ["last.ckpt"]  # never last-v1.ckpt
    assert torch.load(ckpt_dir / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 9


def test_a_linked_last_ckpt_points_at_the_final_step(make_cfg):
    """save_last: link (the paper recipes) with a final step the periodic interval does not fall on."""
    cfg = make_cfg("trainer.max_steps=6")
    with open_dict(cfg):
        cfg.callbacks.model_checkpoint.save_last = "link"
    _, objects = train(cfg)
    ckpt_dir = Path(objects["trainer"].checkpoint_callback.dirpath)
    assert (ckpt_dir / "last.ckpt").is_symlink()
    assert torch.load(ckpt_dir / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 6
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["last.ckpt", "step000006.ckpt"]  # save_top_k: 1


class Gate:
    """AtomicCheckpointIO.save_checkpoint held back until released (a slow disk), recording each write."""

    def __init__(self, monkeypatch):
        import threading

        self.open, self.written, save = threading.Event(), [], AtomicCheckpointIO.save_checkpoint

        def held(io, checkpoint, path, storage_options=None):
            assert self.open.wait(30)
            save(io, checkpoint, path, storage_options)
            self.written.append(Path(path).name)

        monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", held)


def test_background_save_writes_the_state_as_it_was_and_in_order(tmp_path, monkeypatch):
    from t6.training.checkpoint_io import BackgroundCheckpointIO

    gate = Gate(monkeypatch)
    io, weight = BackgroundCheckpointIO(background=True), torch.zeros(4)
    io.save_checkpoint({"w": weight}, tmp_path / "a.ckpt")  # returns while the writer waits
    weight += 1  # training goes on and changes the weights in place
    io.save_checkpoint({"w": weight}, tmp_path / "b.ckpt")
    io.remove_checkpoint(tmp_path / "a.ckpt")  # asked for before a.ckpt is on disk
    assert gate.written == [] and not (tmp_path / "a.ckpt").exists()
    gate.open.set()
    io.wait()
    assert gate.written == ["a.ckpt", "b.ckpt"] and sorted(p.name for p in tmp_path.iterdir()) == ["b.ckpt"]
    assert torch.equal(io.load_checkpoint(tmp_path / "b.ckpt")["w"], torch.ones(4))
    io.save_checkpoint({"w": weight.clone(), "bad": Unpicklable()}, tmp_path / "b.ckpt")
    with pytest.raises(RuntimeError, match="disk full"):  # the writer's error, on the training thread
        io.wait()
    assert torch.equal(io.load_checkpoint(tmp_path / "b.ckpt")["w"], torch.ones(4))  # the old file, whole
    io.teardown()


def test_staged_saves_copy_the_state_as_it_was_into_buffers_kept_from_save_to_save(tmp_path, monkeypatch):
    """HostStaging on host tensors (on a GPU the same, its copies on a side stream): a point-in-time copy, tied
    tensors copied once, the buffers reserved ahead used by the first save, a save while every set is busy given a
    set of its own, and the sets reused once their writes are done."""
    from t6.training.checkpoint_io import BackgroundCheckpointIO

    gate = Gate(monkeypatch)
    io, weight, step = BackgroundCheckpointIO(background=True), torch.zeros(3, 4), torch.tensor(1.0)
    state = lambda: {"state_dict": {"w": weight, "tied": weight}, "opt": {"step": step}}  # noqa: E731
    io.reserve([weight, step])
    io.wait()  # the writer allocated them
    reserved = {t.data_ptr() for ts in io.staging.free[0].values() for t in ts}
    io.save_checkpoint(state(), tmp_path / "a.ckpt")
    assert io.staging.free == []  # the reserved set is a's until a is written
    weight += 1  # training goes on: in place, as an optimizer step
    step += 1
    io.save_checkpoint(state(), tmp_path / "b.ckpt")  # a is not written yet: b gets a set of its own
    gate.open.set()
    io.wait()
    a, b = (io.load_checkpoint(tmp_path / name) for name in ("a.ckpt", "b.ckpt"))
    assert torch.equal(a["state_dict"]["w"], torch.zeros(3, 4)) and a["opt"]["step"] == 1  # as at a's save
    assert torch.equal(b["state_dict"]["w"], torch.ones(3, 4)) and b["opt"]["step"] == 2
    tied = a["state_dict"]["w"], a["state_dict"]["tied"]
    assert tied[0].untyped_storage().data_ptr() == tied[1].untyped_storage().data_ptr()  # one copy, as in training
    assert len(io.staging.free) == 2  # both sets back
    kept = {t.data_ptr() for s in io.staging.free for ts in s.values() for t in ts}
    assert reserved <= kept
    io.save_checkpoint(state(), tmp_path / "c.ckpt")
    io.wait()
    assert {t.data_ptr() for s in io.staging.free for ts in s.values() for t in ts} == kept  # no new buffer
    io.teardown()
    assert io.staging.free == []  # the buffers go with the fit


def test_staging_that_fails_falls_back_to_a_copy_on_the_training_thread(tmp_path, monkeypatch):
    """A staging copy that fails (here: host buffers that cannot be allocated, as pinned memory short) is one
    fallback, "checkpoint_staging": that save and every later one copy on the training thread, still in the
    background, and write the state as it was."""
    from t6.model import fallback
    from t6.training.checkpoint_io import BackgroundCheckpointIO, HostStaging

    def short(specs):
        raise RuntimeError("CUDA error: out of memory (pinned host memory)")

    monkeypatch.setattr(HostStaging, "allocate", staticmethod(short))
    gate = Gate(monkeypatch)
    io, weight = BackgroundCheckpointIO(background=True), torch.zeros(4)
    io.reserve([weight])  # fails on the writer: logged, the save decides
    io.save_checkpoint({"w": weight}, tmp_path / "a.ckpt")
    weight += 1
    assert [e.name for e in fallback.events()] == ["checkpoint_staging"]
    assert not fallback.enabled("checkpoint_staging") and fallback.enabled("background_checkpoint")
    gate.open.set()
    io.wait()
    assert gate.written == ["a.ckpt"] and torch.equal(io.load_checkpoint(tmp_path / "a.ckpt")["w"], torch.zeros(4))
    io.teardown()


def test_a_cpu_checkpoint_is_written_at_once_by_default(tmp_path, monkeypatch):
    from t6.training.checkpoint_io import BackgroundCheckpointIO

    gate = Gate(monkeypatch)
    gate.open.set()
    BackgroundCheckpointIO().save_checkpoint({"w": torch.ones(2)}, tmp_path / "a.ckpt")
    assert gate.written == ["a.ckpt"]  # on return, without a wait


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a checkpoint on a GPU needs CUDA")
def test_a_gpu_checkpoint_is_written_in_the_background_by_default(tmp_path, monkeypatch):
    from t6.training.checkpoint_io import BackgroundCheckpointIO

    gate = Gate(monkeypatch)
    io, weight = BackgroundCheckpointIO(), torch.zeros(4, device="cuda")
    io.save_checkpoint({"w": weight}, tmp_path / "a.ckpt")
    weight += 1
    assert gate.written == []
    gate.open.set()
    io.wait()
    assert torch.equal(io.load_checkpoint(tmp_path / "a.ckpt")["w"], torch.zeros(4))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a side stream needs CUDA")
def test_a_gpu_checkpoint_is_copied_on_a_side_stream_before_the_next_optimizer_step_changes_it(tmp_path, monkeypatch):
    """The copy into pinned buffers runs on a side stream after the work queued before the save (a long matmul
    chain still running on the GPU here), and the next optimizer step waits for it on the GPU: the file holds the
    state as the queued work left it, never a later one, without the training thread waiting."""
    from t6.training.checkpoint_io import BackgroundCheckpointIO

    gate = Gate(monkeypatch)
    io = BackgroundCheckpointIO()
    param = torch.nn.Parameter(torch.zeros(1024, 1024, device="cuda"))
    opt = torch.optim.SGD([param], lr=1.0)
    x = torch.randn(1024, 1024, device="cuda") / 32
    with torch.no_grad():
        y = x
        for _ in range(50):  # queued work the save comes after
            y = y @ x
        param.add_(1.0)
    io.save_checkpoint({"w": param}, tmp_path / "a.ckpt")
    staged = next(iter(io.staging.free), None)
    assert staged is None  # the set is a's until its write ends
    assert io.staging.pending and io.staging.hook is not None  # the next optimizer step waits for the copy
    param.grad = torch.ones_like(param)
    opt.step()  # param -= 1, in place, after the copy
    assert not io.staging.pending and io.staging.hook is None
    gate.open.set()
    io.wait()
    saved = io.load_checkpoint(tmp_path / "a.ckpt")["w"]
    assert saved.device.type == "cpu" and torch.equal(saved, torch.ones(1024, 1024))
    assert torch.equal(param.detach().cpu(), torch.zeros(1024, 1024))
    io.teardown()


def test_sigterm_save_in_the_background_is_on_disk_before_the_run_exits(make_cfg, tmp_path, monkeypatch, stopped):
    import threading

    save = AtomicCheckpointIO.save_checkpoint

    def slow(io, checkpoint, path, storage_options=None):
        assert threading.current_thread() is not threading.main_thread()  # written by the background thread
        threading.Event().wait(1.0)  # a slow disk
        save(io, checkpoint, path, storage_options)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", slow)
    cfg = make_cfg("trainer.plugins.0.background=true", "callbacks.model_checkpoint.every_n_train_steps=0")
    with pytest.raises(SystemExit) as exit_:
        train(in_dir(cfg, tmp_path / "run", "term=test_resume.SigtermAt(3)"))
    stopped(exit_)
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 4 and "optimizer_states" in ckpt  # the step the stop was agreed at, whole


class CrashAt(L.Callback):
    """A crash (an exception, as a killed process leaves no word) at the end of optimizer step `step`, after the
    step's metrics are logged."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError(f"crash after step {self.step}")


@pytest.mark.slow  # two training runs
def test_a_crash_between_the_periodic_checkpoint_and_last_ckpt_resumes_from_the_newest_whole_one(make_cfg, tmp_path):
    """The run saves step000004.ckpt and is killed before the last.ckpt beside it (here: a crash after step 5, then
    last.ckpt removed, a half-written .last.ckpt.PID.tmp left): the re-run resumes from step 4, in the same MLflow
    run, removes the stale file, and the steps it redoes keep one point each in MLflow."""
    run_dir = tmp_path / "crashed"
    every4 = "callbacks.model_checkpoint.every_n_train_steps=4"
    with pytest.raises(RuntimeError, match="crash after step 5"):
        train(in_dir(make_cfg(every4, "trainer.val_check_interval=100"), run_dir, "crash=test_resume.CrashAt(5)"))
    folder = run_dir / "checkpoints"
    (folder / "last.ckpt").unlink()
    stale = folder / ".last.ckpt.4242.tmp"
    stale.write_bytes(b"half a checkpoint")
    uri = make_cfg().logger.mlflow.tracking_uri
    client = mlflow.MlflowClient(tracking_uri=uri)
    (first,) = client.search_runs([e.experiment_id for e in client.search_experiments()])

    _, resumed = train(in_dir(make_cfg(every4, "auto_resume=true", "trainer.val_check_interval=100"), run_dir))
    assert resumed["plan"].resume.step == 4 and resumed["plan"].resume.ckpt_path == str(folder / "step000004.ckpt")
    assert resumed["trainer"].global_step == 8 and not stale.exists()
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])  # one run: the same
    assert run.info.run_id == first.info.run_id and run.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(steps) == list(range(8))  # step 5 was logged before the crash and redone: one point
    assert run.data.tags["redone_steps"] == "5-5"


@pytest.mark.slow  # two processes: one holds a run directory, `python train.py` is started in it
def test_a_second_run_in_a_held_run_directory_names_the_first_and_changes_nothing(tmp_path, shared_data_dir):
    """The second run is refused before Hydra writes its .hydra/ config or its log into the directory: the running
    run's recorded config stays its own (seed 1), no file of the directory changes."""
    import subprocess
    import sys
    import time

    from test_distributed import command

    run_dir = tmp_path / "job"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("seed: 1\n")  # what the first run's Hydra wrote
    (run_dir / "train.log").write_text("the first run's log\n")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from t6.run.process import hold; hold({str(run_dir)!r}); print('held', flush=True); "
            "import time; time.sleep(300)",
        ],  # fmt: skip
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        time.sleep(0.05)  # mtimes of the files now differ from anything a write would give
        before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run_dir.rglob("*") if p.is_file()}
        args, env = command(tmp_path, shared_data_dir, "seed=2", f"hydra.run.dir={run_dir}")
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stderr[-3000:]
        assert f"error: {run_dir} is the run directory of a run still going (pid {holder.pid}" in done.stderr
        assert "Traceback" not in done.stderr
        after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run_dir.rglob("*") if p.is_file()}
        assert after == before  # .hydra/config.yaml still says seed 1; nothing new in the directory
    finally:
        holder.kill()
        holder.wait()
    assert not (tmp_path / "mlruns").exists()  # no MLflow run made


@pytest.mark.slow  # a process of its own importing torch
def test_a_file_size_limit_is_named_as_such_and_the_old_checkpoint_kept(tmp_path):
    """A process whose files may not exceed 100 kB (RLIMIT_FSIZE, `ulimit -f`) asked to write a 4 MiB checkpoint: an
    error naming the limit (not a full disk), before anything is written."""
    import subprocess
    import sys

    from conftest import ROOT

    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"w": torch.zeros(16)}, path)
    script = f"""
import resource, signal, torch
from t6.training.checkpoint_io import AtomicCheckpointIO
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
AtomicCheckpointIO().save_checkpoint({{"w": torch.ones(2**20)}}, {str(path)!r})
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert (
        last.startswith(
            "OSError: [Errno 27] File too large: a checkpoint of 4.0 MiB exceeds this process's file-size limit of "
            "0.1 MiB"
        )
        and str(path) in last
        and "ulimit -f unlimited" in last
    )
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.zeros(16))  # the previous file, whole
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left


@pytest.mark.slow  # train.py in a process of its own
def test_a_run_under_a_file_size_limit_its_checkpoints_exceed_stops_before_training(tmp_path, shared_data_dir):
    """`ulimit -f` below the size of the run's checkpoints: the plan says so (exit 2, no traceback), naming the limit
    and the fix, before anything trains or is tracked (it was a full disk's message, with tens of GB free, after the
    first checkpoint failed)."""
    import resource
    import subprocess

    from test_distributed import command

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (5 * 2**20, resource.RLIM_INFINITY))

    args, env = command(tmp_path, shared_data_dir, f"hydra.run.dir={tmp_path / 'job'}")
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, preexec_fn=limited)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "error: a checkpoint of this run holds ~" in done.stderr and "file-size limit, `ulimit -f`" in done.stderr
    assert "raise the limit (ulimit -f unlimited)" in done.stderr
    assert not (tmp_path / "job").exists() and not (tmp_path / "mlruns").exists()  # nothing trained, nothing tracked
