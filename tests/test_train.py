"""End-to-end training through `train(cfg)`: loss goes down, MLflow has the run, resume continues."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
import torch

from t6.run.closing import closing_summary
from t6.run.samples import SAMPLES_ARTIFACT, check_samples, greedy_samples
from t6.run.train import main as train

from conftest import CONF

OPTIMIZERS = sorted(p.stem for p in (CONF / "optimizer").glob("*.yaml"))


def mlflow_client(cfg) -> mlflow.MlflowClient:
    return mlflow.MlflowClient(tracking_uri=cfg.logger.mlflow.tracking_uri)


@pytest.mark.parametrize("attention", ["mha", "tpa"])
def test_training_lowers_loss_and_lands_in_mlflow(attention, make_cfg):
    cfg = make_cfg(
        f"attention={attention}",
        "trainer.max_steps=40",
        "trainer.val_check_interval=20",
        "lr_ablation.by_size.tiny.warmup_steps=5",
    )
    metrics, objects = train(cfg)
    assert objects["trainer"].global_step == 40
    client = mlflow_client(cfg)
    run = client.get_run(objects["mlflow"].run_id)
    assert run.data.tags["attention"] == attention and run.data.params["size.name"] == "tiny"
    model = objects["model"].model
    assert int(run.data.params["model/params"]) == model.num_params()
    per_layer = model.build_kv_caches(1, 1)[0].elements_per_token()
    assert int(run.data.params["model/kv_cache_bytes_per_token"]) == per_layer * 2 * model.cfg.n_layer  # bf16
    train_loss = [m.value for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert len(train_loss) >= 30
    assert sum(train_loss[-5:]) / 5 < sum(train_loss[:5]) / 5 - 1.0  # from ~10.8 (uniform) clearly down
    val = client.get_metric_history(run.info.run_id, "val/loss")
    assert [m.step for m in val] == [19, 39] and val[-1].value < val[0].value
    assert metrics["val/ppl"] == pytest.approx(torch.exp(torch.tensor(metrics["val/loss"])).item(), rel=1e-5)
    assert "config.yaml" in {a.path for a in client.list_artifacts(run.info.run_id)}
    assert Path(run.data.tags["checkpoints"], "last.ckpt").is_file()


def test_resume_continues_step_count_and_mlflow_run(make_cfg):
    cfg = make_cfg("trainer.max_steps=8")
    _, first = train(cfg)
    last = Path(first["trainer"].checkpoint_callback.dirpath) / "last.ckpt"
    ckpt = torch.load(last, map_location="cpu", weights_only=True)  # loads without running pickled code
    assert ckpt["global_step"] == 8 and ckpt["mlflow_run_id"] == first["mlflow"].run_id

    resumed_cfg = make_cfg("trainer.max_steps=11", f"ckpt_path={last}")
    _, resumed = train(resumed_cfg)
    assert resumed["trainer"].global_step == 11
    final = torch.load(
        Path(resumed["trainer"].checkpoint_callback.dirpath) / "last.ckpt", map_location="cpu", weights_only=True
    )
    assert final["global_step"] == 11  # saved at the end too, not only every 4 steps
    assert resumed["mlflow"].run_id == first["mlflow"].run_id
    steps = [m.step for m in mlflow_client(cfg).get_metric_history(first["mlflow"].run_id, "train/loss")]
    assert sorted(steps) == list(range(11))  # one point per step, numbering continued


def test_closing_summary_shows_a_greedy_sample_and_mlflow_keeps_every_prompt(make_cfg, tmp_path):
    cfg = make_cfg("trainer.max_steps=4", "samples.max_new_tokens=12")
    metrics, objects = train(cfg)
    texts = objects["samples"]
    assert len(texts) == len(cfg.samples.prompts) == 3
    assert all(text.startswith(prompt) and len(text) > len(prompt) for text, prompt in zip(texts, cfg.samples.prompts))
    assert greedy_samples(objects["model"].model, cfg.samples) == texts  # greedy: the same text again
    text = closing_summary(metrics, objects)
    assert f"sample          greedy (every prompt: {SAMPLES_ARTIFACT} in MLflow)" in text
    assert "\n".join(f"    {line}" for line in texts[0].splitlines()) in text  # the first prompt's sample, indented
    client = mlflow_client(cfg)
    run_id = objects["mlflow"].run_id
    assert SAMPLES_ARTIFACT in {a.path for a in client.list_artifacts(run_id)}
    logged = Path(client.download_artifacts(run_id, SAMPLES_ARTIFACT, str(tmp_path))).read_text(encoding="utf-8")
    assert all(sample in logged for sample in texts) and "after step 4" in logged

    off = make_cfg("trainer.max_steps=1", "samples=null")
    metrics, objects = train(off)
    assert objects["samples"] == [] and "sample " not in closing_summary(metrics, objects)
    assert SAMPLES_ARTIFACT not in {a.path for a in client.list_artifacts(objects["mlflow"].run_id)}


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("samples.prompts=[]", "samples.prompts=.*non-empty list"),
        ("samples.prompts=['']", "samples.prompts=.*non-empty strings"),
        ("samples.max_new_tokens=0", "samples.max_new_tokens=0 must be a positive integer"),
        ("samples.prompts=['" + "O Romeo " * 40 + "']", "leaves no room in size.block_size=64"),  # 80 tokens
    ],
)
def test_bad_samples_config_fails_before_training(override, match, make_cfg):
    with pytest.raises(ValueError, match=match):
        check_samples(make_cfg(override))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_every_optimizer_trains(optimizer, make_cfg):
    cfg = make_cfg(f"optimizer={optimizer}", "trainer.max_steps=6", "callbacks.model_checkpoint=null")
    metrics, objects = train(cfg)
    assert objects["trainer"].global_step == 6 and torch.isfinite(torch.tensor(metrics["train/loss"]))
    opt = objects["trainer"].optimizers[0]
    kinds = {g["kind"]: g["weight_decay"] for g in opt.param_groups}
    assert kinds["norm"] == 0.0  # no weight decay on norms, whatever the optimizer


@pytest.mark.slow  # a short training run, ~15-30 s on two cores
def test_gradient_checkpointing_option_recomputes_each_block(make_cfg):
    """gradient_checkpointing=true reaches the trained model: each block runs again in backward (its forward
    pre-hook fires twice per micro-batch; tests/test_hf_transformers.py checks the gradients are the same)."""
    cfg = make_cfg("gradient_checkpointing=true", "trainer.max_steps=2", "callbacks.model_checkpoint=null")
    _, objects = train(cfg)
    model = objects["model"].model.train()
    assert model.gradient_checkpointing
    calls = []
    model.blocks[0].register_forward_pre_hook(lambda *_: calls.append(1))
    idx = torch.randint(0, 100, (1, 16))
    model(idx, targets=idx).backward()  # a recompute stops once it has what backward needs: count pre-hooks
    assert len(calls) == 2
    with pytest.raises(ValueError, match="gradient_checkpointing='yes' must be true or false"):
        train(make_cfg("gradient_checkpointing=yes"))


def test_compiled_module_keeps_plain_checkpoint_keys():
    from t6.training.module import T6LitModule

    cfg = dict(attention="tpa", n_layer=1, d_model=64, n_head=2, vocab_size=128, block_size=16)
    plain, compiled = T6LitModule(model_config=cfg), T6LitModule(model_config=cfg, compile=True)
    assert list(compiled.state_dict()) == list(plain.state_dict())  # compile is lazy: nothing runs here
    # Each transformer block compiled, the unit DDP buckets and FSDP shards: not one graph for the
    # whole model, whose single backward the gradient all-reduce could not overlap.
    assert compiled.model._compiled_call_impl is None
    assert all(block.compiled is not None and block._compiled_call_impl is None for block in compiled.model.blocks)
    assert all(block.compiled is None for block in plain.model.blocks)


@pytest.mark.slow
def test_compiled_training_validates_without_recompiling_and_logs_its_compile_time(make_cfg):
    """compile=true on the CPU with inductor: the blocks' graph compiles once for training and once for
    validation (no gradients), however many windows the validation set has (7 here: batches of 4 and 3
    unpadded), and the first step's time and the compile's share reach MLflow."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = make_cfg("compile=true", "data.val_windows=7", "trainer.max_steps=5", "trainer.val_check_interval=2")
    metrics, objects = train(cfg)
    assert objects["plan"].hardware.compile is True
    assert counters["stats"]["unique_graphs"] == 2  # training, validation: no graph per batch shape
    assert "val/loss" in metrics and torch.isfinite(torch.tensor(metrics["val/loss"]))
    run = mlflow_client(cfg).get_run(objects["mlflow"].run_id)
    first, compile_s = run.data.metrics["perf/first_step_s"], run.data.metrics["perf/compile_s"]
    assert first > compile_s > 0.5 * first  # the first step is mostly compiling
    cache = {k: run.data.metrics[f"perf/compile_cache_{k}"] for k in ("hits", "misses")}
    assert cache["hits"] + cache["misses"] == 2  # training's graph and validation's (step 2): loaded, or compiled


def test_fsdp_mixed_precision_keeps_fp32_parameters_and_autocasts_on_their_device():
    from lightning.pytorch.plugins.precision import FSDPPrecision

    from t6.training.fsdp import T6FSDPStrategy

    strategy = T6FSDPStrategy()
    strategy.precision_plugin = FSDPPrecision("bf16-mixed")  # what Lightning's connector makes of the setting
    mp = strategy.mixed_precision_config
    assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == (torch.float32,) * 3  # gathered, reduced in fp32
    strategy.precision_plugin.device_type = "cpu"  # set from the root device at setup
    with strategy.precision_plugin.forward_context():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    strategy.precision_plugin = FSDPPrecision("bf16-true")
    assert strategy.mixed_precision_config.param_dtype == torch.bfloat16  # a *-true precision stays Lightning's
    assert strategy.kwargs["use_orig_params"] is True  # parameter names survive wrapping


def test_throughput_monitor_logs_tokens_and_mfu_from_the_measured_flops(make_cfg):
    from t6.model.facts import flops_per_token
    from t6.training.callbacks import ThroughputMonitor

    metrics, objects = train(make_cfg("callbacks.throughput.peak_tflops=0.5", "trainer.max_steps=6"))
    monitor = next(cb for cb in objects["trainer"].callbacks if isinstance(cb, ThroughputMonitor))
    cfg, mcfg = objects["plan"].cfg, objects["model"].model
    assert monitor.flops_per_batch == flops_per_token(mcfg, cfg.data.seq_len) * cfg.data.seq_len * cfg.data.batch_size
    c = mlflow.MlflowClient(objects["plan"].tracking.uri)
    run_id = objects["mlflow"].run_id
    got = {
        k: {m.step: m.value for m in c.get_metric_history(run_id, f"train/{k}")}
        for k in ("device/mfu", "device/flops_per_sec", "device/items_per_sec", "device/samples_per_sec")
    }
    assert sorted(got["device/mfu"]) == list(range(1, 6))  # each logging step after the first measurement
    for step, mfu in got["device/mfu"].items():
        assert mfu == pytest.approx(got["device/flops_per_sec"][step] / 0.5e12)
        assert got["device/items_per_sec"][step] == pytest.approx(
            got["device/samples_per_sec"][step] * cfg.data.seq_len
        )
        assert got["device/flops_per_sec"][step] == pytest.approx(
            got["device/items_per_sec"][step] * monitor.flops_per_batch / (cfg.data.seq_len * cfg.data.batch_size)
        )


def test_greedy_samples_in_one_padded_batch_are_each_prompts_own_continuation(tmp_path):
    """The closing samples go in one left-padded generation: each text is what that prompt alone generates. Where
    the longest prompt leaves too little room in the block for every token, one prompt at a time, each capped."""
    from omegaconf import OmegaConf

    from t6.data.tokenizer import gpt2
    from t6.inference.generate import generate_text

    from conftest import random_model

    model = random_model(tmp_path, "attention=tpa")  # block 64
    prompts = ["ROMEO:", "First Citizen: before we proceed any further, hear me speak", "O"]  # lengths differ
    alone = [generate_text(model, [p], 6, 0.0)[0] for p in prompts]
    assert greedy_samples(model, OmegaConf.create({"prompts": prompts, "max_new_tokens": 6})) == alone
    prompts[1] = "Speak" + " to" * 58  # 60 tokens: room for 4 more in the block of 64
    capped = greedy_samples(model, OmegaConf.create({"prompts": prompts, "max_new_tokens": 6}))
    room = [64 - len(gpt2().encode(p)) for p in prompts]  # the block's positions after each prompt
    assert min(room) == 4 < 6 < max(room)
    assert capped == [generate_text(model, [p], min(6, r), 0.0)[0] for p, r in zip(prompts, room)]
