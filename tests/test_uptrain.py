"""Uptraining: MHA -> GQA/MQA conversion by mean-pooling K/V heads, and warm starts through train(cfg)
(conversion into other mechanisms and from pretrained models: tests/test_convert.py)."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import mlflow
import pytest
import torch

from t6.hydra_config import model_config
from t6.model import T6, ModelConfig
from t6.model.loss import mean_loss
from t6.run.plan import plan_run
from t6.run.train import main as train
from t6.uptrain.closed_form import pool_heads
from t6.uptrain.convert import convert_checkpoint, convert_model, load_warm_start, target_config
from t6.uptrain.recipe import adopt_model_config, source_lr, uptrain_steps

from conftest import TEST_RUN

SMALL = dict(vocab_size=512, block_size=32, n_layer=2, d_model=64, n_head=4, head_dim=16)


def random_mha(seed: int = 0, **overrides) -> T6:
    torch.manual_seed(seed)
    model = T6(ModelConfig(attention="mha", **{**SMALL, **overrides}))
    with torch.no_grad():  # residual outputs start at zero; randomize so every path matters
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model.eval()


def converted(model: T6, target: str, kv_heads: int | None, method: str = "mean") -> T6:
    return convert_model(model, target_config(model.cfg, target, kv_heads), method)[0]


def save_training_checkpoint(model: T6, path: Path, **extra) -> Path:
    """The parts of a train.py (Lightning) checkpoint that conversion reads."""
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save(
        {"state_dict": state, "hyper_parameters": {"model_config": asdict(model.cfg)}, "global_step": 10, **extra}, path
    )
    return path


def test_gqa_with_one_group_per_head_is_exact():
    mha = random_mha()
    gqa = converted(mha, "gqa", mha.cfg.n_head)
    idx = torch.randint(0, SMALL["vocab_size"], (2, 20))
    assert torch.equal(gqa(idx), mha(idx))


def test_mqa_kv_weights_are_the_head_mean():
    mha = random_mha()
    mqa = converted(mha, "mqa", None)
    assert mqa.cfg.attention == "mqa" and mqa.blocks[0].attn.n_kv == 1
    h, d = SMALL["n_head"], SMALL["head_dim"]
    for src, dst in zip(mha.blocks, mqa.blocks):
        for name in ("k", "v"):
            w = getattr(src.attn, name).weight  # [h * d, d_model]
            expected = torch.stack([w[i * d : (i + 1) * d] for i in range(h)]).mean(0)  # [d, d_model]
            torch.testing.assert_close(getattr(dst.attn, name).weight, expected, rtol=0, atol=1e-7)
        torch.testing.assert_close(dst.attn.q.weight, src.attn.q.weight, rtol=0, atol=0)
        torch.testing.assert_close(dst.attn.out.weight, src.attn.out.weight, rtol=0, atol=0)
        torch.testing.assert_close(dst.ffn.up.weight, src.ffn.up.weight, rtol=0, atol=0)
    torch.testing.assert_close(mqa.embed.weight, mha.embed.weight, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["mean", "first"])
def test_groups_are_the_query_heads_that_share_a_kv_head(method):
    """An MHA whose K/V heads are already equal within each group of 2 is a GQA(G=2) model: conversion is exact."""
    mha = random_mha()
    h, d = SMALL["n_head"], SMALL["head_dim"]
    with torch.no_grad():
        for block in mha.blocks:
            for lin in (block.attn.k, block.attn.v):
                heads = lin.weight.view(h, d, -1)  # [h, d, d_model]
                heads[1::2] = heads[0::2]  # heads 2g and 2g+1 equal: group g
    gqa = converted(mha, "gqa", 2, method)
    idx = torch.randint(0, SMALL["vocab_size"], (2, 20))
    torch.testing.assert_close(gqa(idx), mha(idx), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(converted(random_mha(), "gqa", 2, method)(idx), random_mha()(idx), atol=1e-3)


def test_first_keeps_each_groups_first_head():
    w = torch.arange(4 * 2 * 3, dtype=torch.float32).view(8, 3)  # 4 heads of d=2, d_model=3
    torch.testing.assert_close(pool_heads(w, 4, 2, "first"), torch.cat([w[0:2], w[4:6]]))
    torch.testing.assert_close(pool_heads(w, 4, 2, "mean"), torch.cat([(w[0:2] + w[2:4]) / 2, (w[4:6] + w[6:8]) / 2]))


def test_clear_errors(tmp_path):
    mha = random_mha()
    ckpt = save_training_checkpoint(mha, tmp_path / "mha.ckpt")
    with pytest.raises(
        ValueError, match=r"target_kv_heads=3 does not divide the source's n_head=4; choose one of \[1, 2, 4\]"
    ):
        convert_checkpoint(ckpt, "gqa", 3)
    with pytest.raises(ValueError, match="target=gqa needs target_kv_heads"):
        convert_checkpoint(ckpt, "gqa", None)
    with pytest.raises(ValueError, match="target=mla takes no target_kv_heads"):
        convert_checkpoint(ckpt, "mla", 2)
    with pytest.raises(ValueError, match="target='nope': attention='nope' is not a known mechanism"):
        convert_checkpoint(ckpt, "nope")

    torch.manual_seed(0)
    tpa = save_training_checkpoint(T6(ModelConfig(attention="tpa", **SMALL)), tmp_path / "tpa.ckpt")
    with pytest.raises(ValueError, match="method=mean pools KV heads: it converts a grouped-query source"):
        convert_checkpoint(tpa, "gqa", 2, method="mean")
    with pytest.raises(ValueError, match="method=closed: there is no closed form from tpa into gqa"):
        convert_checkpoint(tpa, "gqa", 2, method="closed")

    torch.manual_seed(0)
    gqa_weights = T6(ModelConfig(attention="gqa", attention_options={"n_kv_head": 2}, **SMALL))
    lying = tmp_path / "lying.ckpt"  # GQA weights under an MHA model config
    torch.save(
        {
            "state_dict": {f"model.{k}": v for k, v in gqa_weights.state_dict().items()},
            "hyper_parameters": {"model_config": asdict(mha.cfg)},
        },
        lying,
    )
    with pytest.raises(
        ValueError,
        match=r"(?s)weights do not match its model config"
        r".*blocks.0.attn.k.weight: shape \(32, 64\), config says \(64, 64\)",
    ):
        convert_checkpoint(lying, "gqa", 2)

    out = tmp_path / "gqa.ckpt"
    convert_checkpoint(ckpt, "gqa", 2, out=out)
    with pytest.raises(ValueError, match="is not a warm-start checkpoint"):
        load_warm_start(ckpt)
    broken = torch.load(out, weights_only=True)
    broken["model_config"]["n_head"] = 8
    torch.save(broken, tmp_path / "broken.ckpt")
    with pytest.raises(ValueError, match="weights do not match its model config"):
        load_warm_start(tmp_path / "broken.ckpt")


@pytest.mark.slow  # trains a source model, converts it and uptrains twice (~20 s)
def test_converted_model_is_close_to_its_source_and_uptrains(make_cfg, tmp_path):
    # A briefly trained MHA source (the shrunk test model).
    cfg = make_cfg(
        "attention=mha",
        "trainer.max_steps=40",
        "trainer.val_check_interval=40",
        "lr_ablation.by_size.tiny.warmup_steps=5",
        "data.val_windows=8",
    )
    _, source = train(cfg)
    last = Path(source["trainer"].checkpoint_callback.dirpath) / "last.ckpt"
    loader = source["datamodule"].val_dataloader()
    mha = source["model"].model
    src_loss = mean_loss(mha, loader)

    out = tmp_path / "gqa2.ckpt"
    ckpt = convert_checkpoint(last, "gqa", 2, out=out)
    assert ckpt["source"]["mlflow_run_id"] == source["mlflow"].run_id
    assert ckpt["source"]["tokens"] == 40 * 4 * 64  # steps x batch x seq_len
    gqa = T6(ModelConfig(**ckpt["model_config"]))
    gqa.load_state_dict(ckpt["state_dict"])
    conv_loss = mean_loss(gqa, loader)
    torch.manual_seed(0)
    rand_loss = mean_loss(T6(ModelConfig(**ckpt["model_config"])), loader)
    assert math.isfinite(conv_loss)
    assert rand_loss - src_loss > 2.0  # the source learned something
    assert abs(conv_loss - src_loss) < 0.25 * (rand_loss - src_loss)  # converted: much closer to the source than random

    # Uptrain 25% of the source's tokens: 10 steps from the converted weights, a new run tagged with its source.
    run_opts = [o for o in TEST_RUN if not o.startswith(("trainer.max_steps", "trainer.val_check_interval"))]
    up_cfg = make_cfg(
        *run_opts, "experiment=uptrain", f"init_from={out}", "uptrain_fraction=0.25", "data.val_windows=8", small=False
    )
    # The recipe's learning rate starts where the source's schedule ended and decays to a tenth of it.
    assert up_cfg.lr_ablation.max_lr == pytest.approx(cfg.lr_ablation.min_lr)
    assert up_cfg.lr_ablation.min_lr == pytest.approx(0.1 * cfg.lr_ablation.min_lr)
    metrics, up = train(up_cfg)
    assert up["trainer"].global_step == 10
    assert up["model"].model.cfg.attention == "gqa" and up["model"].model.blocks[0].attn.n_kv == 2
    client = mlflow.MlflowClient(tracking_uri=up_cfg.logger.mlflow.tracking_uri)
    run = client.get_run(up["mlflow"].run_id)
    assert run.info.run_id != source["mlflow"].run_id
    assert run.data.tags["source_run_id"] == source["mlflow"].run_id
    assert run.data.tags["init_from"] == str(out) and run.data.tags["attention"] == "gqa"
    first = client.get_metric_history(run.info.run_id, "train/loss")[0]
    assert first.step == 0 and first.value < rand_loss - 1.0  # the first batch already sees trained weights
    assert math.isfinite(metrics["val/loss"]) and metrics["val/loss"] < rand_loss - 2.0


def test_a_warm_starts_block_size_is_the_datas_sequence_length_unless_set(make_cfg, tmp_path):
    out = tmp_path / "mqa.ckpt"
    gpt2 = random_mha(vocab_size=50304)  # the run's tokenizer (GPT-2) fits the model's vocabulary (a plan check)
    convert_checkpoint(save_training_checkpoint(gpt2, tmp_path / "mha.ckpt"), "mqa", out=out)
    plan = plan_run(make_cfg(f"init_from={out}"))  # the config's size.block_size is 64, the model's 32
    assert plan.batch.seq_len == SMALL["block_size"] == plan.model.block_size
    assert plan.cfg.size.block_size == plan.cfg.data.seq_len == 64  # the config as given, nothing written back
    assert plan.logged_cfg.data.seq_len == SMALL["block_size"]  # what MLflow records is what runs
    assert plan_run(make_cfg(f"init_from={out}", "data.seq_len=16")).batch.seq_len == 16  # set: kept


def test_train_tells_warm_start_from_resume(make_cfg, tmp_path):
    ckpt = save_training_checkpoint(random_mha(), tmp_path / "mha.ckpt")
    out = tmp_path / "mqa.ckpt"
    convert_checkpoint(ckpt, "mqa", out=out)
    with pytest.raises(ValueError, match="is a converted .warm-start. checkpoint: start from it with init_from="):
        plan_run(make_cfg(f"ckpt_path={out}"))
    with pytest.raises(ValueError, match="is not a warm-start checkpoint .write one with `python convert.py`"):
        plan_run(make_cfg(f"init_from={ckpt}"))
    odd = torch.load(out, weights_only=True)["model_config"]
    odd["rope_theta"] = 500000.0  # every ModelConfig field is a size.* key, so a warm start's is adopted
    cfg = make_cfg()
    assert "size.rope_theta: 10000.0 -> 500000.0" in adopt_model_config(cfg, odd)
    assert model_config(cfg).rope_theta == 500000.0
    lrs = ["lr_ablation.max_lr=1e-3", "lr_ablation.min_lr=1e-4"]
    with pytest.raises(ValueError, match="does not record how many tokens"):  # no run config, no data position
        plan_run(make_cfg("experiment=uptrain", f"init_from={out}", *lrs, small=False))
    with pytest.raises(
        ValueError, match="records no lr_ablation.min_lr; set lr_ablation.max_lr and lr_ablation.min_lr"
    ):
        plan_run(make_cfg("experiment=uptrain", f"init_from={out}", "trainer.max_steps=2", small=False))
    with pytest.raises(FileNotFoundError, match="init_from='nope.ckpt' does not exist"):
        source_lr("nope.ckpt")


def test_uptrain_steps_divide_the_source_tokens_by_this_runs_global_batch(tmp_path):
    ckpt = save_training_checkpoint(random_mha(), tmp_path / "mha.ckpt", TokenDataModule={"samples_seen": 100})
    out = tmp_path / "mqa.ckpt"
    assert convert_checkpoint(ckpt, "mqa", out=out)["source"]["tokens"] == 100 * SMALL["block_size"]  # 3200
    # half of 3200 tokens at 4 sequences x 2 devices x 2 nodes x 32 tokens = 512 per step: 4 steps (ceil of 3.1)
    assert uptrain_steps(str(out), 0.5, 4, None, 2, 2, 32) == 4
    assert uptrain_steps(str(out), 0.5, 4, 20, "auto", 1, 32) == 3  # the global batch: 20 x 32 = 640 per step
    with pytest.raises(ValueError, match="uptrain_fraction counts tokens per step: .*set data.global_batch_size"):
        uptrain_steps(str(out), 0.5, 4, None, "auto", 1, 32)
