"""Runs that fit the machine: device and precision choice, the step-memory estimate against the measured
peak, the micro-batch the preflight picks and the ranks' agreement on it (the plan's own checks:
tests/test_plan.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from t6.hardware import device, probes
from t6.model.loss import liger_chunk_rows
from t6.run.train import main as train
from t6.training import step_memory as memory

from conftest import compose_config

# ------------------------------------------------------------------------ device and precision


def test_precision_auto_follows_the_device():
    yes, no = (lambda: True), (lambda: False)
    assert device.choose_device("auto", cuda=yes)[0] == "cuda"
    assert device.choose_device("auto", cuda=no)[0] == "cpu"
    assert device.choose_device("cpu", cuda=yes)[0] == "cpu"
    assert device.choose_device("gpu", cuda=no)[0] == "cuda"
    assert device.choose_precision("auto", "cuda", bf16_supported=yes)[0] == "bf16-mixed"
    assert device.choose_precision("auto", "cuda", bf16_supported=no)[0] == "32-true"  # e.g. a V100
    assert device.choose_precision("auto", "cpu", bf16_supported=yes, cpu_bf16=no)[0] == "32-true"
    assert device.choose_precision(None, "cpu", cpu_bf16=no)[0] == "32-true"
    precision, why = device.choose_precision("auto", "cpu", bf16_supported=no, cpu_bf16=yes)
    assert precision == "bf16-mixed" and "AMX" in why  # oneDNN's bf16 matmuls on AMX tiles
    precision, why = device.choose_precision("16-mixed", "cuda", bf16_supported=yes)
    assert precision == "16-mixed" and "explicit" in why  # an explicit precision wins


def test_bf16_means_hardware_bf16_not_emulation(monkeypatch):
    """torch's own check on an imitated GPU: a V100 (7.0) can create bf16 tensors, but only an Ampere
    (8.0) or later computes them on tensor cores; precision=auto must give the V100 32-true."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)  # emulation works
    for major, supported in ((7, False), (8, True), (9, True)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d, major=major: SimpleNamespace(major=major))
        assert device.cuda_bf16_supported() is supported


def test_default_trainer_lets_lightning_choose_and_cpu_gpu_stay_explicit(tmp_path):
    cfg = compose_config([], tmp_path)
    assert (cfg.trainer.accelerator, cfg.trainer.precision, cfg.trainer.devices) == ("auto", "auto", 1)
    cpu = compose_config(["trainer=cpu"], tmp_path).trainer
    assert (cpu.accelerator, cpu.precision, cpu.max_steps) == ("cpu", "32-true", cfg.trainer.max_steps)
    for name in ("gpu", "ddp", "fsdp"):
        trainer = compose_config([f"trainer={name}"], tmp_path).trainer
        assert trainer.accelerator == "gpu" and trainer.precision == "auto"
        assert (
            trainer.plugins[0]._target_ == "t6.training.checkpoint_io.BackgroundCheckpointIO"
        )  # inherited from the default
    ddp = compose_config(["trainer=ddp"], tmp_path).trainer.strategy  # gradients as views into DDP's buckets
    assert ddp._target_ == "lightning.pytorch.strategies.DDPStrategy" and ddp.gradient_as_bucket_view is True


# ------------------------------------------------------------------------------ the preflight


def tiny_model_config():
    from t6.model import ModelConfig

    return ModelConfig(vocab_size=50304, block_size=64, n_layer=2, d_model=64, n_head=2, head_dim=32, attention="mha")


def test_estimate_adds_up_and_scales_as_the_memory_does():
    mcfg = tiny_model_config()
    one = memory.estimate_step_memory(mcfg, 1, 64, loss_chunk_tokens=None)  # all logits at once
    two = memory.estimate_step_memory(mcfg, 2, 64, loss_chunk_tokens=None)
    from t6.model import T6

    n = sum(p.numel() for p in T6(mcfg).parameters())  # the tied head counted once
    assert one.params == one.grads == 4 * n and one.optimizer == 2 * one.params  # fp32, AdamW's two moments
    assert (
        one.loss_transient == 64 * 50304 * 8 and two.loss_transient == 2 * one.loss_transient
    )  # [tokens, vocab] fp32 x 2
    assert one.activations > 64 * 50304 * 4  # the saved log-softmax at least
    assert two.activations - one.activations == pytest.approx(one.activations, rel=0.05)  # linear in the batch
    # The chunked loss (loss_chunk_tokens): one chunk of logits at a time, fp32; it saves the gradients of the
    # hidden states (linear in the batch) and of the head (fixed) instead of [tokens, vocab] log-probs.
    c1, c2 = (memory.estimate_step_memory(mcfg, b, 64, loss_chunk_tokens=1024) for b in (1, 2))
    assert c1.loss_transient == 64 * 50304 * 4 and c1.loss_at(2) == c2.loss_transient == 2 * c1.loss_transient
    assert c1.loss_at(32) == c1.loss_at(64) == 1024 * 50304 * 4  # capped at one chunk
    head = 50304 * 64 * 4
    assert c1.activations - head < one.activations - 64 * 50304 * 4  # no [tokens, vocab] tensor kept
    assert c2.activations - c1.activations == pytest.approx(c1.activations - head, rel=0.05)  # the rest is linear
    # Liger's kernel (loss_impl on CUDA) sizes its own chunk: ~ tokens x d / V rows of logits in the matmul dtype,
    # whatever loss_chunk_tokens says; it saves what the chunked path saves.
    lg = memory.estimate_step_memory(mcfg, 4, 64, precision="bf16-mixed", loss_chunk_tokens=None, liger=True)
    rows = liger_chunk_rows(4 * 64, 50304, 64)
    assert rows == 1 and lg.loss_transient == 50304 * 2  # ceil(256 tokens / ceil(V / d) = 786) rows
    assert lg.loss_at(1024) == 128 * 50304 * 2  # 65536 tokens / 786 -> 84, rounded up to 128 rows
    same = memory.estimate_step_memory(mcfg, 4, 64, precision="bf16-mixed", loss_chunk_tokens=rows)
    assert lg.activations == same.activations
    buckets = memory.estimate_step_memory(mcfg, 1, 64, loss_chunk_tokens=None, ddp_buckets=True)
    assert buckets.total - one.total == buckets.buckets == one.grads and "DDP buckets" in buckets.describe()
    sharded = memory.estimate_step_memory(mcfg, 1, 64, shards=4)
    assert (sharded.params, sharded.grads, sharded.optimizer) == (one.params // 4, one.grads // 4, one.optimizer // 4)
    ckpt = memory.estimate_step_memory(mcfg, 1, 64, activation_checkpointing=True)
    assert ckpt.activations < one.activations
    bf16 = memory.estimate_step_memory(mcfg, 1, 64, precision="bf16-true")
    assert bf16.params == one.params // 2


def test_peak_rss_of_a_child_is_its_own_not_its_parents():
    """A child started by a process holding 1 GiB reports its own peak (ru_maxrss would not: Linux
    carries the parent's high-water mark across exec, as under a long pytest session)."""
    held = torch.ones(2**28)  # 1 GiB resident in this process
    code = "from t6.hardware.probes import peak_rss, process_rss; print(peak_rss(), process_rss())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    peak, now = map(int, done.stdout.split())
    assert probes.peak_rss() >= held.numel() * 4
    assert now <= peak < held.numel() * 4 // 2


@pytest.mark.slow
def test_estimate_is_within_25_percent_of_the_measured_peak_at_tiny():
    """A real training step of size=tiny (micro-batch 8) in a fresh process: the preflight's estimate
    against the process's own peak RSS (fp32, as the rest of the suite)."""
    from t6.bench.train_memory import run_case

    result = run_case("tiny", 8, extra=("trainer.precision=32-true",))
    assert result["measure"] == "peak RSS (VmHWM)" and result["measured"] > 1e9
    assert 0.75 <= result["ratio"] <= 1.25, result


def cap_memory(monkeypatch, bytes_available: int) -> None:
    """Present the machine as having bytes_available free (and the process as holding nothing)."""
    monkeypatch.setattr(probes, "available_memory", lambda device, index=0: (bytes_available, "test cap"))
    monkeypatch.setattr(probes, "process_rss", lambda: 0)


def test_auto_micro_batch_keeps_the_global_batch_and_the_optimization(make_cfg, monkeypatch):
    run = ["trainer.max_steps=2", "callbacks.model_checkpoint=null", "data.global_batch_size=8"]
    full_metrics, full = train(make_cfg(*run, "data.batch_size=8"))
    assert full["trainer"].accumulate_grad_batches == 1

    cfg = make_cfg(*run, "data.batch_size=auto")
    from t6.hydra_config import model_config

    def est(b: int) -> int:
        return memory.estimate_step_memory(
            model_config(cfg), b, cfg.data.seq_len, accumulate=2, loss_chunk_tokens=cfg.loss_chunk_tokens
        ).total

    # the cap: micro-batch 2 fits, 4 does not
    cap_memory(monkeypatch, int((est(2) + est(4)) / 2 / (1 - memory.MARGIN)))
    metrics, split = train(cfg)
    assert split["datamodule"].batch_size == 2 and split["trainer"].accumulate_grad_batches == 4
    assert split["plan"].batch.memory.auto and split["plan"].batch.micro_batch == 2
    assert split["datamodule"].samples_seen() == 2 * 8  # steps x global batch, as before
    for a, b in zip(full["model"].parameters(), split["model"].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # the same two optimizer steps
    assert metrics["val/loss"] == pytest.approx(full_metrics["val/loss"], rel=1e-4)  # the same 8 windows


def test_auto_picks_the_whole_share_when_it_fits(make_cfg):
    _, objects = train(
        make_cfg(
            "data.batch_size=auto", "data.global_batch_size=8", "trainer.max_steps=1", "callbacks.model_checkpoint=null"
        )
    )
    assert objects["datamodule"].batch_size == 8 and objects["trainer"].accumulate_grad_batches == 1


def _compare_plans(rank: int, batches: tuple[int, int], port: int, out: Path) -> None:
    """One rank of a 2-process gloo group: SameMicroBatch.setup through Lightning's own all_gather."""
    import torch.distributed as dist
    from lightning.pytorch.strategies import DDPStrategy

    from t6.training.callbacks import SameMicroBatch

    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    trainer = SimpleNamespace(world_size=2, strategy=DDPStrategy(parallel_devices=[torch.device("cpu")] * 2))
    try:
        SameMicroBatch(batches[rank], (40 - 10 * rank) * 2**30).setup(trainer, None, "fit")
        (out / f"rank{rank}").write_text("ok")
    except MemoryError as e:
        (out / f"rank{rank}").write_text(str(e))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("batches", [(8, 8), (8, 4)], ids=["same", "different"])
def test_ranks_that_planned_different_micro_batches_stop_together_before_training(batches, tmp_path):
    """data.batch_size=auto plans on each device's free memory; two ranks with different plans would
    hang at their first unpaired collective. Both must raise, naming the batch that fits both."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_compare_plans, args=(batches, port, tmp_path), nprocs=2, start_method="fork")
    said = [(tmp_path / f"rank{r}").read_text() for r in range(2)]
    if batches[0] == batches[1]:
        assert said == ["ok", "ok"]
    else:
        assert said[0] == said[1] and "rank 0: 8 (40.0 GiB free), rank 1: 4 (30.0 GiB free)" in said[0]
        assert "set data.batch_size=4, which fits every device" in said[0]


def test_the_supported_torch_range_holds_the_pinned_torch_and_the_gpu_images():
    from t6.hardware.device import torch_supported

    assert torch_supported()  # the installed, pinned torch
    assert torch_supported("2.11.0+cu130") and torch_supported("2.13.0+cpu")
    assert not torch_supported("2.10.1") and not torch_supported("2.14.0")
