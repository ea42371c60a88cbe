"""What a run keeps and uploads: logger.mlflow.log_model chooses one file, uploaded at the end."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
import torch

from t6.model.load import load_model
from t6.run.process import MLFLOW_HTTP, environment
from t6.run.train import main as train
from t6.tracking.mlflow import log_model_choice


@pytest.fixture
def quick_mlflow():
    """MLflow's client failing a request fast, as a run sets it while it logs (t6.run.process.run_settings)."""
    with environment(MLFLOW_HTTP):
        yield


def artifacts(run_id: str, uri: str) -> list[str]:
    client = mlflow.MlflowClient(tracking_uri=uri)
    return sorted(f.path for f in client.list_artifacts(run_id, "model"))


def test_log_model_final_uploads_only_the_weights_only_model(make_cfg, tmp_path):
    cfg = make_cfg("logger.mlflow.log_model=final")
    _, objects = train(cfg)
    ckpt_dir = tmp_path / "run" / "checkpoints"
    run_id, uri = objects["mlflow"].run_id, cfg.logger.mlflow.tracking_uri
    assert artifacts(run_id, uri) == ["model/model.ckpt"]
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["last.ckpt", "step000008.ckpt"]  # one copy: in the store
    model = Path(mlflow.MlflowClient(uri).download_artifacts(run_id, "model/model.ckpt", str(tmp_path)))
    assert objects["uploaded"].endswith("/model/model.ckpt")
    last = ckpt_dir / "last.ckpt"
    weights = torch.load(model, map_location="cpu", weights_only=True)
    assert "optimizer_states" not in weights and "optimizer_states" in torch.load(last, weights_only=True)
    assert model.stat().st_size < 0.5 * last.stat().st_size  # AdamW keeps two more tensors per weight
    assert weights["global_step"] == 8
    loaded = load_model(model, device="cpu")  # generate.py / eval.py read it as they read last.ckpt
    for name, tensor in objects["model"].model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_local_store_keeps_its_artifacts_beside_its_database(make_cfg, tmp_path, monkeypatch):
    store = tmp_path / "elsewhere"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}/mlflow.db")
    cfg = make_cfg("logger.mlflow.log_model=final", "trainer.max_steps=1", store=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}/mlflow.db")  # make_cfg clears it
    _, objects = train(cfg)
    run_id = objects["mlflow"].run_id
    assert objects["uploaded"].endswith(f"{run_id}/artifacts/model/model.ckpt")  # the artifact's URI, as MLflow says
    assert [p.relative_to(store) for p in store.rglob("model.ckpt")] == [
        Path("artifacts", run_id, "artifacts", "model", "model.ckpt")
    ]
    assert not (tmp_path / "mlruns").exists()


def test_log_model_last_uploads_the_resumable_checkpoint_and_false_nothing(make_cfg, tmp_path):
    cfg = make_cfg("logger.mlflow.log_model=last", "trainer.max_steps=4")
    _, objects = train(cfg)
    assert artifacts(objects["mlflow"].run_id, cfg.logger.mlflow.tracking_uri) == ["model/last.ckpt"]
    assert not (tmp_path / "run" / "checkpoints" / "model.ckpt").exists()

    cfg = make_cfg("trainer.max_steps=4")  # the tests' default: log_model=false
    with_nothing = train(cfg)[1]
    assert artifacts(with_nothing["mlflow"].run_id, cfg.logger.mlflow.tracking_uri) == []


def test_log_model_choices(make_cfg):
    assert make_cfg(small=False).logger.mlflow.log_model == "final"  # the default: the model, not the optimizer
    assert [log_model_choice(v) for v in (True, "final", "last", False, None)] == ["final", "final", "last", None, None]
    with pytest.raises(ValueError, match="log_model='all' must be final .* last .* or false"):
        log_model_choice("all")


def test_eval_py_without_a_checkpoint_says_what_to_give(make_cfg):
    from t6.evaluation.evaluate import evaluate_checkpoint

    with pytest.raises(ValueError, match="ckpt_path is required: python eval.py ckpt_path="):
        evaluate_checkpoint(make_cfg(config_name="evaluate", small=False))


def test_experiment_opens_as_model_training_and_runs_log_system_metrics(make_cfg):
    cfg = make_cfg(
        "trainer.max_steps=20", "logger.mlflow.system_metrics_interval_s=0.5", "callbacks.model_checkpoint=null"
    )
    _, objects = train(cfg)
    client = mlflow.MlflowClient(tracking_uri=cfg.logger.mlflow.tracking_uri)
    experiment = client.get_experiment(objects["mlflow"].experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    metrics = client.get_run(objects["mlflow"].run_id).data.metrics
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(metrics)


def local_run(tmp_path):
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    from t6.tracking.mlflow import open_tracking_store

    open_tracking_store(uri)
    client = mlflow.MlflowClient(tracking_uri=uri)
    return uri, client, client.create_run(client.create_experiment("outbox")).info.run_id


def test_writes_wait_in_the_outbox_while_the_store_is_down_and_sync_sends_them(tmp_path, quick_mlflow):
    import time

    from mlflow.entities import Metric

    from t6.tracking.outbox import Outbox, OutboxClient
    from t6.tracking.sync import main as sync

    uri, client, run_id = local_run(tmp_path)
    outbox = Outbox("http://127.0.0.1:9", tmp_path / "outbox" / "rank0.jsonl")  # a server that never answers
    down = OutboxClient(outbox)
    client.log_param(run_id, "lr", "1")
    start = time.perf_counter()
    for step in range(50):
        down.log_batch(run_id, metrics=[Metric("train/loss", 10.0 - step / 10, 1000 + step, step)])
        if step == 10:
            down.log_param(run_id, "lr", "2")  # a write the store will refuse (a parameter cannot change)
    down.set_tag(run_id, "last_step", "50")
    down.set_terminated(run_id, "KILLED")
    assert time.perf_counter() - start < 1.0  # training never waits for the store
    assert not outbox.close(timeout_s=1.0) and outbox.unreachable_since is not None

    assert sync([str(tmp_path / "outbox"), "--tracking-uri", uri]) == 0  # the command the warning names
    run = client.get_run(run_id)
    losses = client.get_metric_history(run_id, "train/loss")
    assert [m.step for m in sorted(losses, key=lambda m: m.step)] == list(range(50))
    assert run.data.tags["last_step"] == "50" and run.info.status == "KILLED"  # the writes after it arrived
    assert run.data.params["lr"] == "1"
    assert sync([str(tmp_path / "outbox"), "--tracking-uri", uri]) == 0  # again: nothing left to send
    assert len(client.get_metric_history(run_id, "train/loss")) == 50


def test_the_outbox_retries_with_backoff_in_order_and_a_later_process_sends_what_was_left(
    tmp_path, monkeypatch, quick_mlflow
):
    from mlflow.entities import Metric

    from t6.tracking.outbox import Outbox, OutboxClient

    uri, client, run_id = local_run(tmp_path)
    spool = tmp_path / "outbox" / "rank0.jsonl"
    first = Outbox("http://127.0.0.1:9", spool)
    OutboxClient(first).log_batch(run_id, metrics=[Metric("m", 1.0, 1, 0)])
    first.close(timeout_s=0.5)  # a process that ended with the store down

    calls = []
    real = mlflow.MlflowClient.log_batch

    def flaky(self, *args, **kwargs):  # the store answers from the third try on
        calls.append(kwargs["metrics"][0].step if kwargs.get("metrics") else None)
        if len(calls) < 3:
            raise ConnectionError("store down")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(mlflow.MlflowClient, "log_batch", flaky)
    second = Outbox(uri, spool)  # the resumed run: the same spool, the store reachable again
    writer = OutboxClient(second)
    for step in (1, 2):
        writer.log_batch(run_id, metrics=[Metric("m", float(step + 1), 2 + step, step)])
    assert second.close(timeout_s=30)
    assert calls[:3] == [0, 0, 0]  # the earlier process's write first, retried until the store took it
    history = sorted(client.get_metric_history(run_id, "m"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [(0, 1.0), (1, 2.0), (2, 3.0)]


def test_a_continued_run_is_known_while_the_store_is_down(tmp_path, quick_mlflow):
    from t6.tracking.logger import OutboxMLFlowLogger

    logger = OutboxMLFlowLogger(
        experiment_name="t6",
        run_name="tpa-tiny",
        tracking_uri="http://127.0.0.1:9",
        run_id="abc",
        outbox_dir=tmp_path / "outbox",
        flush_timeout_s=0.5,
    )
    run = logger.experiment.get_run("abc")  # Lightning's logger would read the run from the store first
    assert run.info.run_id == "abc" and run.info.run_name == "tpa-tiny"
    logger.log_metrics({"train/loss": 1.0}, step=0)
    assert not logger.close()
    assert '"train/loss", 1.0' in (tmp_path / "outbox" / "rank0.jsonl").read_text()


@pytest.mark.slow  # ~6 s of a store down and back
def test_the_flush_retries_until_its_deadline_when_the_store_comes_back(tmp_path, quick_mlflow, monkeypatch):
    """The store down while the run logs (the sender's backoff grows to seconds), back during the end-of-run flush:
    every write arrives before the flush's deadline."""
    import threading
    import time

    from mlflow.entities import Metric

    from t6.tracking.outbox import Outbox, OutboxClient

    uri, client, run_id = local_run(tmp_path)
    down, real = [True], mlflow.MlflowClient.log_batch

    def store(self, *args, **kwargs):  # the store's answer: none while down
        if down[0]:
            raise ConnectionError("store down")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(mlflow.MlflowClient, "log_batch", store)
    outbox = Outbox(uri, tmp_path / "outbox" / "rank0.jsonl")
    writer = OutboxClient(outbox)
    for step in range(30):
        writer.log_batch(run_id, metrics=[Metric("train/loss", float(step), 1000 + step, step)])
    time.sleep(3.5)  # tried at 0, 1 and 3 s: the next try 4 s on, then 8
    threading.Timer(1.0, lambda: down.__setitem__(0, False)).start()  # back 1 s into the flush
    start = time.monotonic()
    assert outbox.flush(timeout_s=5.0) and time.monotonic() - start < 3.5
    assert outbox.close(timeout_s=1.0)
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == list(range(30))


@pytest.mark.slow  # two training runs
def test_the_summary_names_the_model_only_once_the_store_has_it(make_cfg, monkeypatch):
    from t6.run.closing import closing_summary

    _, first = train(make_cfg("trainer.max_steps=2", "logger.mlflow.log_model=final"))
    assert f"model           {first['uploaded']}" in closing_summary({}, first)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # the server gone
    cfg = make_cfg(
        "trainer.max_steps=3", "ckpt_path=last", "logger.mlflow.log_model=final", "logger.mlflow.flush_timeout_s=1"
    )
    metrics, resumed = train(cfg)
    text = closing_summary(metrics, resumed)
    outbox = resumed["mlflow"].outbox_dir
    assert not resumed["sent"] and "model           not uploaded yet" in text and "model           http" not in text
    assert f"python -m t6.tracking.sync {outbox}" in text
