"""What a run keeps and uploads: logger.mlflow.log_model chooses one file, uploaded at the end."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
import torch

from t6.inference.generate import load_model
from t6.run.train import train
from t6.tracking.mlflow import log_model_choice


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
    cfg = make_cfg("logger.mlflow.log_model=final", "trainer.max_steps=1")
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
    from t6.evaluation.checkpoint import evaluate_checkpoint

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
