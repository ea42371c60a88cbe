"""What a run keeps and uploads: logger.mlflow.log_model chooses one file, uploaded at the end."""

from __future__ import annotations

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
    model, last = ckpt_dir / "model.ckpt", ckpt_dir / "last.ckpt"
    assert artifacts(objects["mlflow"].run_id, cfg.logger.mlflow.tracking_uri) == ["model/model.ckpt"]
    weights = torch.load(model, map_location="cpu", weights_only=True)
    assert "optimizer_states" not in weights and "optimizer_states" in torch.load(last, weights_only=True)
    assert model.stat().st_size < 0.5 * last.stat().st_size  # AdamW keeps two more tensors per weight
    assert weights["global_step"] == 8
    loaded = load_model(model)  # generate.py / eval.py read it as they read last.ckpt
    for name, tensor in objects["model"].model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


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


def test_one_source_for_the_learning_rate_and_dataset_points_to_prepare(make_cfg):
    with pytest.raises(
        ValueError, match=r"optimizer.lr=0.01 differs from lr_ablation.max_lr=0.003.*lr_ablation.max_lr=0.01"
    ):
        train(make_cfg("optimizer.lr=0.01"))
    with pytest.raises(ValueError, match="dataset= chooses what prepare.py tokenizes.*data=local"):
        train(make_cfg("dataset=local"))


def test_eval_py_without_a_checkpoint_says_what_to_give(make_cfg):
    from t6.evaluation.checkpoint import evaluate_checkpoint

    with pytest.raises(ValueError, match="ckpt_path is required: python eval.py ckpt_path="):
        evaluate_checkpoint(make_cfg(config_name="evaluate", small=False))
