"""Faults at cluster scale, on CPU processes with gloo through torchrun: stop signals to random subsets of ranks
at random moments (training, validation, evaluation, checkpoint writing; SIGTERM, SIGINT, SIGUSR1, SIGUSR2,
and submitit's requeue), a rank killed with SIGKILL, a disk that fills during a checkpoint write, and the MLflow
server killed and restarted mid-run (and down at a resume). For every trial: no hang, no step lost beyond the last
checkpoint, resumed losses equal to an uninterrupted run's, one MLflow run.

The seeded trials share their processes (tests/fault_worker.py: one torchrun job runs them all); the others need
processes of their own. With T6_FAULTS_OUT=DIR the trials' records are written to DIR/trials.json (the table of
experiments/faults/README.md is made from it by experiments/faults/report.py)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import ROOT

pytestmark = pytest.mark.slow
STEPS = 10  # optimizer steps of a trial's run (validation after 3, 6, 9; checkpoints at 4, 8; evaluation at 5)
PHASE_STEPS = {"train": range(1, 7), "validation": [3, 6], "eval": [5], "checkpoint": [4]}
SIGNALS = ["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"]
PRIORITY = ["SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2"]  # t6.training.stop.STOP_SIGNALS: the agreed one
RECORDS: list[dict] = []  # every trial's outcome, for T6_FAULTS_OUT


def trial_spec(seed: int, world: int, submitit: bool = False) -> dict:
    """A random subset of ranks, each signalled once (its own signal, phase, step and delay)."""
    rng = random.Random(seed)
    ranks = sorted(rng.sample(range(world), rng.randint(1, world)))
    events = []
    for rank in ranks:
        phase = rng.choice(["train", "train", "validation", "eval", "checkpoint"])
        events.append(
            {
                "rank": rank,
                "phase": phase,
                "step": rng.choice(list(PHASE_STEPS[phase])),
                "signal": "SIGUSR2" if submitit else rng.choice(SIGNALS),
                "delay_ms": round(rng.uniform(0, 150 if phase == "train" else 20), 1),  # inside the phase
            }
        )
    name = f"w{world}-s{seed}" + ("-submitit" if submitit else "")
    return {
        "name": name,
        "seed": seed,
        "events": events,
        "eval": any(e["phase"] == "eval" for e in events),
        "submitit": submitit,
    }


def torchrun(nproc: int, *args: str, env: dict, **popen) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.Popen(command, env=env, cwd=ROOT, start_new_session=True, **popen)


def environment(root: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(
        T6_ROOT=str(root),
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]),
        MLFLOW_ENABLE_ASYNC_LOGGING="false",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def run_trials(root: Path, data_dir: Path, world: int, trials: list[dict], timeout_s: float) -> dict[str, list[dict]]:
    """Run the trials in one torchrun job of `world` processes; each trial's records, one per rank."""
    reference = {"name": f"w{world}-reference", "seed": None, "events": [], "eval": False, "submitit": False}
    spec = {
        "root": str(root),
        "data_dir": str(data_dir),
        "world": world,
        "steps": STEPS,
        "trial_timeout_s": 240,
        "trials": [reference, *trials],
    }
    (root / "spec.json").write_text(json.dumps(spec))
    log = root / "torchrun.log"
    with open(log, "w") as out:
        proc = torchrun(
            world,
            str(ROOT / "tests" / "fault_worker.py"),
            str(root / "spec.json"),
            env=environment(root),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = "hung"
    records = [
        json.loads((root / f"rank{r}.json").read_text()) if (root / f"rank{r}.json").exists() else []
        for r in range(world)
    ]
    done = min(len(r) for r in records)
    assert code == 0 and done == len(spec["trials"]), f"torchrun {code}, {done} trials done:\n{log.read_text()[-6000:]}"
    return {trial["name"]: [records[r][i] for r in range(world)] for i, trial in enumerate(spec["trials"])}


def check_trial(trial: dict, ranks: list[dict], reference: list[dict]) -> dict:
    """Every rank stopped at the same step with the agreed signal and its exit code, the checkpoint holds that
    step, the resumed losses equal the uninterrupted run's, and one MLflow run logged each step once."""
    name, world = trial["name"], len(ranks)
    landed = [event for r in ranks for event in r["landed"]]  # those due after the stop never fire
    assert landed, name
    first = min(event["landed_step"] for event in landed)
    stop = ranks[0]["last_ckpt_step"]
    agreed = ranks[0]["interrupted"]["signal"]
    # the agreement (at the end of step `stop`) saw every signal that landed before that step began, and the
    # highest of them ranks first; one landing during that step may or may not have been in time
    seen = [e["signal"] for e in landed if e["landed_step"] <= stop - 2] or [agreed]
    assert agreed in {e["signal"] for e in landed}, (name, agreed, landed)
    assert PRIORITY.index(agreed) >= max(PRIORITY.index(signal) for signal in seen), (name, agreed, landed)
    for r in ranks:
        interrupted = r["interrupted"]
        assert interrupted["stopped"] and interrupted["signal"] == agreed, (name, r["rank"], interrupted)
        assert interrupted["last_step"] == r["last_ckpt_step"] == stop, (name, r["rank"])  # no step lost
        expected = 128 + signal.Signals[agreed]
        if trial["submitit"] and r["rank"] == 0:
            expected = 144  # submitit's LocalJobEnvironment requeues by exiting 144
            assert r["requeue"] == {"last_ckpt_step_at_requeue": stop}, (name, r["requeue"])  # checkpoint, then requeue
        assert interrupted["exit_code"] == expected, (name, r["rank"], interrupted)
        assert r["resumed"] == {**r["resumed"], "stopped": False, "global_step": STEPS}, (name, r["resumed"])
    assert first + 1 <= stop <= first + 2, (name, first, stop)  # the step boundary after the signal landed
    deltas = [  # relative; bitwise with 2 ranks, within 1-2 ulps with 4 (the resumed run's first step reduces
        # its gradients in DDP's initial bucket layout, the uninterrupted run's in the rebuilt one)
        abs(r["loss"][str(step)] - ref["loss"][str(step)]) / abs(ref["loss"][str(step)])
        for r, ref in zip(ranks, reference)
        for step in range(1, STEPS + 1)
    ]
    assert max(deltas) <= 1e-6, (name, max(deltas))
    view = ranks[0]["mlflow"]
    assert view["runs"] == 1 and view["status"] == "FINISHED", (name, view)
    assert view["loss_steps"] == {str(step): 1 for step in range(STEPS)}, (name, view["loss_steps"])
    return {
        "trial": name,
        "world": world,
        "signals": {str(e["rank"]): e["signal"] for e in landed},
        "landed": sorted({e["landed_phase"] for e in landed}),
        "agreed": agreed,
        "stop_step": stop,
        "checkpoint_step": stop,
        "steps_lost": 0,
        "exit_codes": sorted({r["interrupted"]["exit_code"] for r in ranks}),
        "max_rel_loss_delta": max(deltas),
        "mlflow_runs": view["runs"],
        "stop_s": round(max(r["interrupted"]["seconds"] for r in ranks), 1),
        "hung": False,
    }


# The seeded trials the suite runs: (plain seeds, submitit seeds) on 4 ranks, chosen from the first 8 seeds so that
# the events sure to land (each trial's earliest) cover every signal and phase, a signal on several ranks, and
# submitit's requeue with and without rank 0 signalled (test_the_trials_cover_every_signal_and_phase). Two ranks are
# the same protocol with fewer subsets to pick (the SIGKILL, disk and server trials below run on two): the
# experiment (T6_FAULTS_OUT set: experiments/faults/) runs all 20 trials, 12 of them on 2 ranks.
TRIALS = {4: ([100, 103, 104, 105], [107])}
ALL_TRIALS = {2: (range(0, 10), range(10, 12)), 4: (range(100, 106), range(106, 108))}


def sure_events(trial: dict) -> list[dict]:
    """The events due at the trial's earliest step: they land before the stop (at least a step later)."""
    first = min(e["step"] for e in trial["events"])
    return [e for e in trial["events"] if e["step"] == first]


@pytest.mark.parametrize("world", sorted(TRIALS))
def test_the_trials_cover_every_signal_and_phase(world):
    plain, submitit = TRIALS[world]
    trials = [trial_spec(s, world) for s in plain] + [trial_spec(s, world, submitit=True) for s in submitit]
    sure = [e for t in trials for e in sure_events(t)]
    assert {e["signal"] for e in sure} == set(SIGNALS) and {e["phase"] for e in sure} == set(PHASE_STEPS), world
    assert any(len({e["rank"] for e in sure_events(t)}) > 1 for t in trials), world  # several ranks at once
    requeued = [{e["rank"] for e in sure_events(t)} for t in trials if t["submitit"]]
    assert any(0 not in ranks for ranks in requeued), world  # rank 0 requeues though another rank was signalled


@pytest.mark.parametrize("world", sorted(ALL_TRIALS), ids=lambda world: f"{world}-ranks")
def test_stop_signals_to_random_ranks_lose_nothing(tmp_path, shared_data_dir, world):
    experiment = bool(os.environ.get("T6_FAULTS_OUT"))
    if not experiment and world not in TRIALS:
        pytest.skip(f"the {world}-rank trials run in the experiment (T6_FAULTS_OUT, experiments/faults/)")
    seeds, submitit = (ALL_TRIALS if experiment else TRIALS)[world]
    trials = [trial_spec(s, world) for s in seeds] + [trial_spec(s, world, submitit=True) for s in submitit]
    results = run_trials(tmp_path, shared_data_dir, world, trials, timeout_s=900)
    reference = results[f"w{world}-reference"]
    for trial in trials:
        RECORDS.append(check_trial(trial, results[trial["name"]], reference))
    write_records()


def write_records() -> None:
    out = os.environ.get("T6_FAULTS_OUT")
    if out:
        from t6.bench.harness import environment

        path = Path(out) / "trials.json"
        old = json.loads(path.read_text())["trials"] if path.exists() else []
        names = {r["trial"] for r in RECORDS}
        trials = [r for r in old if r["trial"] not in names] + RECORDS
        versions = {name: importlib.metadata.version(name) for name in ("lightning", "mlflow", "submitit")}
        payload = {"benchmark": "faults", "environment": {**environment("cpu"), **versions}, "trials": trials}
        path.write_text(json.dumps(payload, indent=1) + "\n")  # python -m t6.report.experiments renders it


def step_of(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


def workers(proc: subprocess.Popen, count: int, timeout_s: float = 300) -> list[psutil.Process]:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        found = [c for c in psutil.Process(proc.pid).children(recursive=True) if "train.py" in " ".join(c.cmdline())]
        if len(found) == count:
            return found
        time.sleep(0.2)
    raise TimeoutError("torchrun did not start its workers")


DDP = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]
SMALL = ["data.batch_size=2", "data.seq_len=32", "data.val_windows=4", "samples=null"]


def train_command(root: Path, data_dir: Path, *overrides: str) -> tuple[list[str], dict]:
    from test_distributed import command

    args, env = command(root, data_dir, *DDP, *SMALL, *overrides)
    return args[1:], env  # train.py and its overrides, for torchrun


def wait_for(condition, proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-4000:]
        time.sleep(0.2)


def loss_history(uri: str) -> tuple[object, dict[int, list[float]]]:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history: dict[int, list[float]] = {}
    for m in sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.timestamp):
        history.setdefault(m.step, []).append(m.value)
    return run, history


def test_a_rank_killed_with_sigkill_stops_the_others_and_keeps_the_last_checkpoint(tmp_path, shared_data_dir):
    run_dir = tmp_path / "job"
    args, env = train_command(
        tmp_path,
        shared_data_dir,
        "trainer.max_steps=100000",
        "callbacks.model_checkpoint.every_n_train_steps=2",
        f"hydra.run.dir={run_dir}",
    )
    log = tmp_path / "torchrun.log"
    with open(log, "w") as out:
        proc = torchrun(2, *args, env=env, stdout=out, stderr=subprocess.STDOUT)
    ranks = workers(proc, 2)
    last = run_dir / "checkpoints" / "last.ckpt"
    wait_for(lambda: last.is_file() and step_of(last) >= 4, proc, log)
    victim = random.Random(0).randrange(2)
    ranks[victim].kill()
    killed = time.time()
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the other rank did not stop within 120 s of rank {victim}'s SIGKILL:\n{log.read_text()[-4000:]}")
    stopped_s = time.time() - killed
    text = log.read_text()
    assert code != 0 and f"rank      : {victim} (local_rank: {victim})" in text and "exitcode  : -9" in text
    survivor = 1 - victim
    assert f"training stopped on rank {survivor} of 2" in text and f"the last complete checkpoint is {last}" in text
    saved = step_of(last)  # whole (it loads), and the newest periodic checkpoint's step
    periodic = sorted(run_dir.glob("checkpoints/step*.ckpt"))
    assert saved % 2 == 0 and step_of(periodic[-1]) == saved
    RECORDS.append(
        {
            "trial": "sigkill-rank",
            "world": 2,
            "signals": {str(victim): "SIGKILL"},
            "landed": ["train"],
            "agreed": None,
            "stop_step": None,
            "checkpoint_step": saved,
            "steps_lost": "since the last periodic checkpoint (every 2)",
            "exit_codes": [-9],
            "max_rel_loss_delta": None,
            "mlflow_runs": 1,
            "stop_s": round(stopped_s, 1),
            "hung": False,
        }
    )
    write_records()


def mount_tmpfs_works(path: Path) -> bool:
    probe = subprocess.run(
        ["unshare", "--mount", "--map-root-user", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {path}"],
        capture_output=True,
    )
    return probe.returncode == 0


def test_a_disk_that_fills_during_a_checkpoint_write_keeps_the_last_checkpoint(tmp_path, shared_data_dir):
    """The checkpoints go to a 60 MB tmpfs in a mount namespace the test creates: one resumable checkpoint of this
    model fits (41 MB: step000002.ckpt, with last.ckpt a hard link to it), the second write (step 4) does not.
    Where no namespace can mount one, rank 0's files are capped at that moment instead (RLIMIT_FSIZE). The run stops
    naming the error and the last complete checkpoint; resumed on a disk with room, its losses repeat the first
    run's."""
    run_dir, ckpt_dir, kept = tmp_path / "job", tmp_path / "job" / "checkpoints", tmp_path / "kept"
    ckpt_dir.mkdir(parents=True)
    base = [
        "trainer.max_steps=8",
        "callbacks.model_checkpoint.every_n_train_steps=2",
        "trainer.val_check_interval=100",
        f"hydra.run.dir={run_dir}",
    ]
    namespace = mount_tmpfs_works(ckpt_dir)
    fill = (
        []
        if namespace
        else [
            "+callbacks.fill._target_=fault_worker.FillDisk",
            "+callbacks.fill.step=3",
            "+callbacks.fill.max_bytes=20000000",
        ]
    )
    args, env = train_command(tmp_path, shared_data_dir, *base, *fill)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args]
    if namespace:  # the checkpoints of the run, then what the tmpfs held, copied out before the namespace ends
        script = f'mount -t tmpfs -o size=60m tmpfs {ckpt_dir} && "$@"; code=$?; cp -a {ckpt_dir}/. {kept}/; exit $code'
        launch = ["unshare", "--mount", "--map-root-user", "sh", "-c", script, "sh", *launch]
        kept.mkdir()
    started = time.time()
    proc = subprocess.run(launch, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert ("No space left on device" if namespace else "File too large") in text, text[-4000:]
    if namespace:
        for path in kept.iterdir():
            path.rename(ckpt_dir / path.name)
    last = ckpt_dir / "last.ckpt"
    assert step_of(last) == 2 and sorted(p.name for p in ckpt_dir.iterdir()) == ["last.ckpt", "step000002.ckpt"]
    assert f"the last complete checkpoint is {last}" in text
    failed_s = time.time() - started

    args, env = train_command(tmp_path, shared_data_dir, *base, "auto_resume=true")
    resumed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert step_of(last) == 8
    run, history = loss_history(f"sqlite:///{tmp_path}/mlruns/mlflow.db")  # one run: the resume continued it
    assert sorted(history) == list(range(8)) and run.info.status == "FINISHED"
    assert all(len(values) == 1 for values in history.values()), history  # a redone step is not logged twice
    assert run.data.tags["redone_steps"] == "3-3"  # step 3 (logged at 2); step 4 failed in its write, before its log
    RECORDS.append(
        {
            "trial": "disk-full" + ("-tmpfs" if namespace else "-rlimit"),
            "world": 2,
            "signals": {},
            "landed": ["checkpoint"],
            "agreed": None,
            "stop_step": None,
            "checkpoint_step": 2,
            "steps_lost": 2,  # steps 3 and 4, since the checkpoint of step 2
            "exit_codes": [proc.returncode],
            "max_rel_loss_delta": None,  # the redone step 3 is logged once: the trials compare resumed losses
            "mlflow_runs": 1,
            "stop_s": round(failed_s, 1),
            "hung": False,
        }
    )
    write_records()


class MLflowServer:
    """`mlflow server` on 127.0.0.1:port over a SQLite store, stopped (SIGKILL to its process group, as a crashed
    or evicted server) and started again on the same port and store."""

    def __init__(self, root: Path):
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.root, self.url, self.proc = root, f"http://127.0.0.1:{self.port}", None

    def start(self) -> None:
        import urllib.request

        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        args = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port)]
        args += ["--backend-store-uri", f"sqlite:///{self.root}/server.db", "--workers", "1"]
        args += ["--artifacts-destination", str(self.root / "artifacts")]
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-2000:]
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        pytest.fail("mlflow server did not start within 120 s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def two_nodes(root: Path, data_dir: Path, url: str, tag: str, *overrides: str) -> list[subprocess.Popen]:
    """The job on 2 nodes of 1 process each: one torchrun agent per node, as a cluster starts them."""
    import socket

    from test_distributed import command

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args, env = command(
        root,
        data_dir,
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=1",
        "trainer.num_nodes=2",
        "trainer.precision=32-true",
        *SMALL,
        *overrides,
    )
    env["MLFLOW_TRACKING_URI"] = url
    procs = []
    for node in range(2):
        launch = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=1",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            *args[1:],
        ]
        out = open(root / f"{tag}-node{node}.log", "w")
        procs.append(
            subprocess.Popen(launch, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        )
    return procs


def progress(log: Path) -> int:
    """The last optimizer step a node 0 log printed (t6's progress lines: `step N/M ...`)."""
    import re

    steps = re.findall(r"^step (\d+)/", log.read_text(errors="replace"), flags=re.M)
    return int(steps[-1]) if steps else 0


def wait_all(procs: list[subprocess.Popen], timeout_s: float, logs: list[Path]) -> list[int]:
    deadline = time.time() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            pytest.fail("hung:\n" + "\n".join(log.read_text()[-3000:] for log in logs))
    return [proc.returncode for proc in procs]


def test_the_tracking_server_goes_away_and_comes_back(tmp_path, shared_data_dir):
    """Two nodes (torchrun agents) log to an MLflow server that is killed at step 3 and restarted while they train
    (the writes wait, then arrive), killed again, and the job is stopped by SIGTERM to both workers 0-100 ms
    apart (both stop at one step and save); resumed while the server is still down (the plan says so, training
    runs to its end in the outbox), then the server returns and `python -m t6.tracking.sync` sends the rest: one
    MLflow run, FINISHED, every step's loss once, system metrics from both nodes."""
    import mlflow

    server = MLflowServer(tmp_path)
    server.start()
    run_dir = tmp_path / "job"
    common = [
        f"hydra.run.dir={run_dir}",
        "logger.mlflow.system_metrics_interval_s=1",
        "logger.mlflow.flush_timeout_s=3",
        "callbacks.model_checkpoint.every_n_train_steps=1000",
        "trainer.val_check_interval=1000",
        "+callbacks.pace._target_=fault_worker.Pace",
        "+callbacks.pace.seconds=0.25",
    ]
    try:
        first = two_nodes(tmp_path, shared_data_dir, server.url, "first", *common, "trainer.max_steps=100000")
        logs = [tmp_path / f"first-node{n}.log" for n in range(2)]
        wait_for(lambda: progress(logs[0]) >= 3, first[0], logs[0])
        server.kill()
        down = time.time()
        wait_for(lambda: progress(logs[0]) >= 8, first[0], logs[0])
        server.start()  # back while the job trains
        back = time.time()
        wait_for(lambda: "answers again" in logs[0].read_text(), first[0], logs[0], timeout_s=120)
        server.kill()
        ranks = [workers(proc, 1)[0] for proc in first]
        rng = random.Random(1)
        order = rng.sample(ranks, 2)
        order[0].send_signal(signal.SIGTERM)
        time.sleep(rng.uniform(0, 0.1))
        order[1].send_signal(signal.SIGTERM)
        codes = wait_all(first, 120, logs)
        text = logs[0].read_text()
        assert codes == [1, 1] and all("exitcode  : 143" in log.read_text() for log in logs), text[-3000:]
        assert "terminated (SIGTERM): last.ckpt saved" in text and "send them with `python -m t6.tracking.sync" in text
        stop = step_of(run_dir / "checkpoints" / "last.ckpt")
        assert stop == progress(logs[0])  # the step both stopped at, saved: none lost

        second = two_nodes(
            tmp_path,
            shared_data_dir,
            server.url,
            "second",
            *common,
            "auto_resume=true",
            f"trainer.max_steps={stop + 6}",
        )
        logs = [tmp_path / f"second-node{n}.log" for n in range(2)]
        assert wait_all(second, 300, logs) == [0, 0]
        text = logs[0].read_text()
        assert "the server is unreachable" in text, text[-3000:]  # the plan says so
        assert step_of(run_dir / "checkpoints" / "last.ckpt") == stop + 6

        server.start()
        sync = subprocess.run(
            [sys.executable, "-m", "t6.tracking.sync", str(run_dir / "mlflow-outbox")],
            env=environment(tmp_path),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert sync.returncode == 0, sync.stderr[-3000:]
        client = mlflow.MlflowClient(tracking_uri=server.url)
        (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert run.info.status == "FINISHED"
        losses = client.get_metric_history(run.info.run_id, "train/loss")
        assert sorted(m.step for m in losses) == list(range(stop + 6))  # every step once
        assert any(down * 1000 < m.timestamp < back * 1000 for m in losses)  # logged while the server was down
        keys = set(run.data.metrics)
        assert {"system/node0/cpu_utilization_percentage", "system/node1/cpu_utilization_percentage"} <= keys
    finally:
        server.kill()
    RECORDS.append(
        {
            "trial": "mlflow-server-down",
            "world": 2,
            "signals": {"0": "SIGTERM", "1": "SIGTERM"},
            "landed": ["train"],
            "agreed": "SIGTERM",
            "stop_step": stop,
            "checkpoint_step": stop,
            "steps_lost": 0,
            "exit_codes": [143],
            "max_rel_loss_delta": None,
            "mlflow_runs": 1,
            "stop_s": None,
            "hung": False,
        }
    )
    write_records()
