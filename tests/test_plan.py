"""A run's plan (`t6.run.plan.plan_run`): every decision and every check before anything is built, every
problem of the config at once, nothing written; and what the command line says about a mistake."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from t6.data.corpus import TINY_SHAKESPEARE, prepare_text_corpus
from t6.data.shards import ShardError
from t6.errors import ConfigError, DamagedFile, SettingError
from t6.hardware import device, probes
from t6.run.plan import Strategy, plan_run, strategy_kind
from t6.training import step_memory as memory

from conftest import ROOT


def files_under(path: Path) -> set[Path]:
    return {p for p in path.rglob("*")} if path.exists() else set()


def test_a_plan_decides_everything_and_writes_nothing(make_cfg, tmp_path, shared_data_dir):
    prepare_text_corpus(TINY_SHAKESPEARE, shared_data_dir / "tinyshakespeare")  # the data as a run leaves it
    cfg = make_cfg("trainer.max_steps=2")
    before_cfg, before_files = cfg.copy(), files_under(tmp_path)
    plan = plan_run(cfg)
    assert files_under(tmp_path) == before_files and cfg == before_cfg  # no store, run dir or config change
    assert (plan.hardware.device, plan.hardware.precision) == ("cpu", "32-true")
    assert plan.parallel.strategy is Strategy.SINGLE and plan.parallel.world_size == 1
    assert (plan.batch.micro_batch, plan.batch.accumulation, plan.batch.per_step) == (4, 1, 4)
    assert plan.training.loss_impl == "chunked" and plan.training.val_check_interval == 4
    assert plan.resume is None and plan.tracking.run_id is None
    text = plan.describe()
    assert "device          cpu (" in text and "precision 32-true (" in text
    assert "batch           4 sequences x 64 tokens per step = micro-batch 4 x 1 accumulation step(s)" in text
    assert "memory          data.batch_size micro-batch 4" in text and "GiB" in text
    assert "schedule        warmup 10 of 2 steps" in text and "tracking        MLflow sqlite:///" in text
    assert plan.params()["plan/micro_batch"] == 4 and plan.params()["plan/strategy"] == "single"


def test_every_problem_of_the_config_is_reported_at_once(make_cfg, tmp_path):
    cfg = make_cfg(
        "attention=tpa",
        "attention.options.k_rank=0",
        "size.head_dim=63",
        "data.batch_size=0",
        "optimizer.lr=0.01",
        "loss_impl=fused",
        "+trainer.max_step=6",
        "samples.max_new_tokens=0",
    )
    with pytest.raises(ConfigError) as err:
        plan_run(cfg)
    assert err.value.problems == [
        "size.head_dim=63 must be even (RoPE rotates pairs of dimensions)",
        "attention.options.k_rank=0 must be a positive integer",
        "optimizer.lr=0.01 differs from lr_ablation.max_lr=0.003, the schedule's peak; set the peak with "
        "lr_ablation.max_lr=0.01 (and lr_ablation.min_lr), and leave optimizer.lr to follow it",
        "data.batch_size=0 must be a positive number of sequences per device and micro-step, or auto (the largest "
        "that fits the device's memory); e.g. data.batch_size=8",
        "samples.max_new_tokens=0 must be a positive integer",
        "loss_impl='fused' must be one of auto, chunked, liger",
        "trainer.max_step is not a setting of lightning.Trainer; did you mean trainer.max_steps?",
    ]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["data.batch_size=-2"], r"data.batch_size=-2 must be a positive number"),
        (["data.batch_size=1.5"], r"data.batch_size=1.5 must be a positive number"),
        (["data.batch_size=auto", "data.global_batch_size=null"], "data.batch_size=auto needs data.global_batch_size"),
        (["data.seq_len=128"], r"data.seq_len=128 is longer than size.block_size=64.*data.seq_len<=64"),
        (["dataset=local"], "dataset= chooses what prepare.py tokenizes.*data=local"),
        (["eval=local", "eval.num_fewshot=[-1]"], r"eval.num_fewshot=\[-1\] must hold numbers of examples >= 0"),
        (["nonfinite_loss=ignore"], "nonfinite_loss='ignore' must be 'stop' or 'skip'"),
        (["compile=yes"], "compile='yes' must be auto .on CUDA, off on the CPU., true or false"),
        (["callbacks.model_checkpoint.every_n_train_steps=-1"], "every_n_train_steps=-1 must be auto"),
        (
            [
                "trainer=fsdp",
                "trainer.accelerator=cpu",
                "trainer.devices=2",
                "trainer.strategy.state_dict_type=sharded",
            ],
            r"state_dict_type=sharded: .*single files.*use trainer.strategy.state_dict_type=full",
        ),
    ],
)
def test_a_bad_setting_names_its_field(overrides, match, make_cfg):
    with pytest.raises(ConfigError, match=match):
        plan_run(make_cfg(*overrides))


def test_compile_auto_is_on_for_cuda_and_off_for_the_cpu():
    assert device.choose_compile("auto", "cuda")[0] is True
    assert device.choose_compile("auto", "cpu")[0] is False
    assert device.choose_compile(True, "cpu") == (True, "compile=true")
    assert device.choose_compile(False, "cuda") == (False, "compile=false")


def test_the_plan_decides_compile_and_the_checkpoints(make_cfg, monkeypatch, tmp_path):
    monkeypatch.setattr(device, "measured_matmul_flops", lambda *_: 1e11)  # a 100 GFLOP/s CPU
    plan = plan_run(make_cfg("callbacks.model_checkpoint.every_n_train_steps=auto", "trainer.max_steps=100000"))
    assert plan.hardware.compile is False and plan.params()["plan/compile"] is False
    every = plan.checkpoints.every_n_steps
    assert isinstance(every, int) and every >= 1
    assert plan.checkpoints.background is False  # a CPU run's state is written at once
    text = plan.describe()
    assert "compile         off (compile=auto on cpu" in text
    assert f"checkpoints     every {every} steps, written synchronously (auto: Young's interval" in text
    short = plan_run(make_cfg("callbacks.model_checkpoint.every_n_train_steps=auto", "trainer.max_steps=2"))
    assert short.checkpoints.every_n_steps == 0  # only last.ckpt, at the end
    assert "checkpoints     at the end only" in short.describe()
    cache = tmp_path / "compile-cache"
    on = plan_run(make_cfg("compile=true", "trainer.plugins.0.background=true", f"paths.compile_cache_dir={cache}"))
    assert on.hardware.compile is True and on.checkpoints.background is True
    assert "the first step and the first validation compile (expect ~" in on.describe()
    assert f"cache {cache}: cold (empty" in on.describe() and not cache.exists()  # the plan writes nothing
    (cache / "aotautograd" / "entry").mkdir(parents=True)  # what an earlier run compiled
    warm = plan_run(make_cfg("compile=true", f"paths.compile_cache_dir={cache}"))
    assert f"cache {cache}: warm (1 compiled graph from earlier runs" in warm.describe()


def test_checkpoint_interval_is_youngs_rounded_down():
    from t6.training.callbacks.checkpoint import FAILURE_INTERVAL_S, WRITE_BYTES_S, checkpoint_interval, nice_floor

    assert [nice_floor(x) for x in (1, 1.9, 2, 4.9, 5, 9.99, 10, 88, 199, 500, 12_345)] == [
        1, 1, 2, 2, 5, 5, 10, 50, 100, 500, 10_000
    ]  # fmt: skip
    state = int(WRITE_BYTES_S)  # written synchronously, a save blocks 1 s: Young's interval sqrt(2 x 1 s x 24 h)
    step_s = (2 * FAILURE_INTERVAL_S) ** 0.5 / 300  # ... which is 300 steps
    assert checkpoint_interval(state, step_s, False, 10_000)[0] == 200  # rounded down
    assert checkpoint_interval(state, step_s, True, 10_000)[0] == 50  # blocks 0.1 s in the background: 94.9 steps
    assert checkpoint_interval(state, step_s, False, 300)[0] == 0  # the run is no longer: only last.ckpt


def test_liger_where_triton_cannot_run_is_an_error(make_cfg, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="loss_impl=liger needs a CUDA device"):
        plan_run(make_cfg("loss_impl=liger", "trainer.accelerator=cpu"))


def test_a_gpu_trainer_without_a_gpu_says_so(make_cfg, monkeypatch):
    monkeypatch.setattr(device, "cuda_available", lambda: False)
    with pytest.raises(ConfigError, match="this machine has no CUDA GPU; use trainer=default"):
        plan_run(make_cfg("trainer=gpu"))


def test_the_strategy_is_read_from_the_class_it_names(make_cfg):
    from t6.run.sections import Component, read_sections

    assert strategy_kind(None, 1) is Strategy.SINGLE and strategy_kind("auto", 2) is Strategy.DDP
    assert strategy_kind("ddp_spawn", 2) is Strategy.DDP and strategy_kind("fsdp", 2) is Strategy.FSDP
    for group, kind in (("ddp", Strategy.DDP), ("fsdp", Strategy.FSDP)):
        assert strategy_kind(read_sections(make_cfg(f"trainer={group}", small=False))[0].trainer.strategy, 8) is kind
    subclass = Component("strategy", "t6.training.fsdp.T6FSDPStrategy")
    assert strategy_kind(subclass, 2) is Strategy.FSDP  # a subclass of FSDPStrategy, whatever it is called
    tensor_parallel = Component("strategy", "lightning.pytorch.strategies.ModelParallelStrategy")
    with pytest.raises(ConfigError, match="a run is planned for one device, DDP or FSDP"):
        strategy_kind(tensor_parallel, 2)
    with pytest.raises(ConfigError, match="trainer.strategy='ddpp' is not a Lightning strategy name"):
        strategy_kind("ddpp", 2)


def test_an_fsdp_plan_shards_the_memory_and_counts_the_processes(make_cfg, monkeypatch):
    monkeypatch.setattr(device, "cuda_available", lambda: True)
    monkeypatch.setattr(device, "cuda_bf16_supported", lambda: True)
    monkeypatch.setattr(probes, "available_memory", lambda dev, index=0: (80 * probes.GIB, f"device {index}"))
    monkeypatch.setattr(device, "peak_flops", lambda dev, dtype: (989e12, "an H100's bf16 peak"))
    monkeypatch.setenv("LOCAL_RANK", "3")
    cfg = make_cfg(
        "trainer=fsdp",
        "trainer.devices=8",
        "trainer.num_nodes=2",
        "trainer.precision=auto",
        "data.global_batch_size=64",
    )
    plan = plan_run(cfg)
    assert plan.parallel.strategy is Strategy.FSDP and plan.parallel.world_size == 16
    assert plan.parallel.device_index == 3 and plan.batch.memory.source == "device 3"
    assert plan.batch.memory.estimate.notes[0] == "FSDP: parameters, gradients and optimizer state sharded 16 ways"
    assert plan.hardware.precision == "bf16-mixed" and "processes       16 (FSDP: 8 device(s) x 2 node(s))" in (
        plan.describe()
    )
    assert plan.hardware.compile is True  # compile=auto on CUDA
    assert "peak            989 TFLOP/s (an H100's bf16 peak)" in plan.describe()
    assert plan.params()["plan/peak_tflops"] == 989  # MFU's denominator, for the throughput callback
    assert plan.checkpoints.background is False  # FSDP gathers the state into host memory: written at once
    assert plan.training.optimizer_args == {"fused": True}  # AdamW as one kernel on CUDA
    gpu = plan_run(make_cfg("trainer=gpu", "trainer.max_steps=8", "trainer.val_check_interval=4"))
    assert gpu.checkpoints.background is True and "written in the background" in gpu.describe()
    with pytest.raises(ConfigError, match="optimizer=MuonWithAdamW needs whole 2-D weight matrices.*trainer=ddp"):
        plan_run(make_cfg("trainer=fsdp", "trainer.devices=8", "optimizer=muon", "data.global_batch_size=64"))


def cap_memory(monkeypatch, bytes_available: int) -> None:
    """Present the machine as having bytes_available free (and the process as holding nothing)."""
    monkeypatch.setattr(probes, "available_memory", lambda device, index=0: (bytes_available, "test cap"))
    monkeypatch.setattr(probes, "process_rss", lambda: 0)


def test_a_micro_batch_that_cannot_fit_fails_naming_the_ways_out(make_cfg, monkeypatch):
    cap_memory(monkeypatch, 50 * 2**20)
    with pytest.raises(MemoryError) as err:
        plan_run(make_cfg("data.batch_size=4"))
    text = str(err.value)
    for part in (
        "data.batch_size=4 does not fit",
        "GiB",
        "test cap",
        "data.batch_size=auto",
        "gradient_checkpointing=true",
        "trainer.strategy.activation_checkpointing=true",
        "trainer=fsdp",
    ):
        assert part in text, text
    with pytest.raises(MemoryError, match="data.batch_size=auto: even a micro-batch of 1 needs"):
        plan_run(make_cfg("data.batch_size=auto", "data.global_batch_size=4"))


def test_auto_takes_the_largest_micro_batch_that_fits(make_cfg, monkeypatch):
    from t6.hydra_config import model_config

    cfg = make_cfg("data.batch_size=auto", "data.global_batch_size=8")

    def est(b: int) -> int:  # with accumulation (every gradient alive during backward), as both candidates have
        return memory.estimate_step_memory(model_config(cfg), b, 64, accumulate=2, loss_chunk_tokens=1024).total

    cap_memory(monkeypatch, int((est(2) + est(4)) / 2 / (1 - memory.MARGIN)))  # micro-batch 2 fits, 4 does not
    plan = plan_run(cfg)
    assert (plan.batch.micro_batch, plan.batch.accumulation, plan.batch.per_step) == (2, 4, 8)
    assert plan.batch.memory.auto and plan.params()["plan/micro_batch"] == 2  # logged as the number used
    assert plan.cfg == cfg  # decided in the plan's fields: the config keeps its auto


@pytest.fixture
def corrupted(tmp_path) -> Path:
    """A training checkpoint cut in half, as a full disk or a killed copy leaves it."""
    from t6.training.module import T6LitModule

    path = tmp_path / "broken.ckpt"
    module = T6LitModule(
        model_config=dict(attention="mha", n_layer=1, d_model=64, n_head=2, vocab_size=128, block_size=16)
    )
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": {"model_config": {}}}, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def test_a_damaged_or_missing_checkpoint_is_named(make_cfg, corrupted):
    with pytest.raises(ValueError, match=re.escape(f"ckpt_path='{corrupted}' is not a readable checkpoint")) as err:
        plan_run(make_cfg(f"ckpt_path={corrupted}"))
    assert "an earlier step*.ckpt" in str(err.value)
    with pytest.raises(FileNotFoundError, match="ckpt_path='nope.ckpt' does not exist; give a checkpoint file"):
        plan_run(make_cfg("ckpt_path=nope.ckpt"))
    with pytest.raises(FileNotFoundError, match="ckpt_path=last: .*checkpoints holds no whole checkpoint"):
        plan_run(make_cfg("ckpt_path=last"))


def test_corrupted_checkpoint_in_generate_eval_and_convert(corrupted):
    from t6.model.load import load_model
    from t6.uptrain.convert import convert_checkpoint

    with pytest.raises(ValueError, match=re.escape(f"ckpt_path='{corrupted}' is not a readable checkpoint")):
        load_model(corrupted)
    with pytest.raises(ValueError, match=re.escape(f"checkpoint='{corrupted}' is not a readable checkpoint")):
        load_model(corrupted, what="checkpoint")
    with pytest.raises(ValueError, match=re.escape(f"ckpt_path='{corrupted}' is not a readable checkpoint")):
        convert_checkpoint(corrupted, "gqa", 1)


def test_a_corrupted_shard_is_named(make_cfg, tmp_path):
    data_dir = tmp_path / "corrupt"
    prepare_text_corpus(TINY_SHAKESPEARE, data_dir)
    cfg = make_cfg(f"data.data_dir={data_dir}", "data.embedded=false")  # prepared shards, no re-tokenization
    shard = data_dir / "train_000000.bin"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ShardError, match=f"shard {shard} is truncated or corrupted"):
        plan_run(cfg)


def test_an_unreachable_tracking_server_is_named(make_cfg, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    with pytest.raises(ConnectionError, match="127.0.0.1:9 is unreachable"):
        plan_run(make_cfg())


def test_a_resume_says_where_it_continues_and_needs_its_mlflow_run(make_cfg, tmp_path, monkeypatch):
    from t6.run.train import main as train

    _, first = train(make_cfg("trainer.max_steps=4", "callbacks.model_checkpoint.every_n_train_steps=2"))
    last = Path(first["trainer"].checkpoint_callback.dirpath) / "last.ckpt"
    plan = plan_run(make_cfg("trainer.max_steps=6", "ckpt_path=last"))
    assert plan.resume.step == 4 and plan.tracking.run_id == first["mlflow"].run_id
    assert f"resume          from step 4 of {last} (ckpt_path=last: the run directory's newest whole" in plan.describe()
    assert f"continues run {first['mlflow'].run_id}" in plan.describe()

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/other/mlflow.db")  # a store without that run
    with pytest.raises(ValueError) as err:
        plan_run(make_cfg("trainer.max_steps=6", "ckpt_path=last"))
    text = str(err.value)
    assert f"continues MLflow run {first['mlflow'].run_id}, which the tracking store sqlite:///{tmp_path}" in text
    assert "point MLFLOW_TRACKING_URI at the store" in text and "logger.mlflow.continue_run=false" in text
    fresh = plan_run(make_cfg("trainer.max_steps=6", "ckpt_path=last", "logger.mlflow.continue_run=false"))
    assert fresh.resume.step == 4 and fresh.tracking.run_id is None  # the training continues, in a new MLflow run


def test_a_sharded_checkpoint_directory_is_not_resumed_from_silently(make_cfg):
    """A sharded FSDP checkpoint is a directory: auto_resume would not see it as last.ckpt and start over."""
    cfg = make_cfg("auto_resume=true")
    last = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    last.mkdir(parents=True)
    with pytest.raises(ValueError, match=r"last.ckpt is a directory \(a sharded FSDP checkpoint.*state_dict_type=full"):
        plan_run(cfg)
    with pytest.raises(ValueError, match="is a directory"):
        plan_run(make_cfg(f"ckpt_path={last}"))


def test_a_resume_with_the_tracking_server_down_says_so_and_goes_on(make_cfg, tmp_path, monkeypatch):
    from t6.run.train import main as train

    _, first = train(make_cfg("trainer.max_steps=2", "callbacks.model_checkpoint.every_n_train_steps=2"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing answers there
    plan = plan_run(make_cfg("trainer.max_steps=4", "ckpt_path=last"))
    assert plan.tracking.run_id == first["mlflow"].run_id and "Connection refused" in plan.tracking.unreachable
    assert "MLflow http://127.0.0.1:9" in plan.describe()
    outbox = Path(plan.cfg.paths.output_dir) / "mlflow-outbox"
    note = (
        f"the server is unreachable ({plan.tracking.unreachable}): training goes on, logging to {outbox}, sent to "
        f"the server when it answers; what is left at the end: python -m t6.tracking.sync {outbox}"
    )
    assert note in plan.describe() and note in plan.warnings
    with pytest.raises(ConnectionError, match="127.0.0.1:9 is unreachable"):  # a new run needs the server
        plan_run(make_cfg("trainer.max_steps=4"))


def test_a_run_that_never_leaves_warmup_is_warned_with_a_fix_that_changes_something(make_cfg):
    plan = plan_run(make_cfg("trainer.max_steps=2", "callbacks.model_checkpoint=null"))
    (warning,) = plan.warnings
    assert "lr_ablation.warmup_steps=10 >= trainer.max_steps=2" in warning and "lr_ablation.max_lr" in warning
    assert "raise trainer.max_steps above 10" in warning
    one = plan_run(make_cfg("trainer.max_steps=1", "lr_ablation.by_size.tiny.warmup_steps=1"))
    assert "lr_ablation.warmup_steps=1 >= trainer.max_steps=1" in one.warnings[0]
    assert "lower lr_ablation.warmup_steps" not in one.warnings[0]  # it is already as low as it goes


def test_the_run_announces_its_plan(make_cfg, caplog):
    from t6.run.train import main as train

    caplog.set_level(logging.INFO, logger="t6.run.execute")
    _, objects = train(make_cfg("trainer.max_steps=2", "callbacks.model_checkpoint=null"))
    assert objects["plan"].describe() in caplog.text and objects["trainer"].precision == "32-true"
    assert "lr_ablation.warmup_steps=10 >= trainer.max_steps=2" in caplog.text  # the plan's warning, said once


def cli(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", *args, f"paths.root_dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow  # three interpreters importing Lightning (~15 s each)
def test_the_command_line_names_the_fix_without_a_traceback(tmp_path):
    done = cli("trainer.max_step=6", tmp_path=tmp_path)  # a misspelled key
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "error: trainer.max_step is not a setting; did you mean trainer.max_steps?" in done.stderr
    assert "+trainer.max_step" not in done.stderr  # Hydra's advice would only move the error into Lightning

    done = cli("attention.options.k_rank=0", "size.head_dim=63", tmp_path=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "  - size.head_dim=63 must be even" in done.stderr and "  - attention.options.k_rank=0" in done.stderr
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").rglob("*.ckpt"))

    done = cli("+trainer.max_step=6", tmp_path=tmp_path)
    assert done.returncode == 2 and "did you mean trainer.max_steps?" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("override", "field", "says"),
    [
        ("trainer.max_steps=-1", "trainer.max_steps=-1", "would train without end"),
        ("trainer.max_steps=0", "trainer.max_steps=0", "would train nothing"),
        ("lr_ablation.by_size.tiny.max_lr=-1", "lr_ablation.max_lr=-1", "a positive learning rate"),
        ("lr_ablation.by_size.tiny.min_lr=0.1", "lr_ablation.min_lr=0.1", "between 0 and lr_ablation.max_lr"),
        ("lr_ablation.by_size.tiny.warmup_steps=-3", "lr_ablation.warmup_steps=-3", ">= 0"),
        ("trainer.val_check_interval=0", "trainer.val_check_interval=0", "a positive number of optimizer steps"),
        ("trainer.log_every_n_steps=0", "trainer.log_every_n_steps=0", "a positive number"),
        ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val=-1", ">= 0 or null"),
        ("optimizer.weight_decay=-0.1", "optimizer.weight_decay=-0.1", ">= 0"),
        ("data.val_windows=0", "data.val_windows=0", "positive or null"),
        ("loss_chunk_tokens=0", "loss_chunk_tokens=0", "a positive number or null"),
        ("logger.mlflow.flush_timeout_s=-1", "logger.mlflow.flush_timeout_s=-1", ">= 0"),
        ("size.vocab_size=1000", "size.vocab_size=1000", "smaller than the tokenizer's 50,257 tokens"),
    ],
)
def test_every_number_is_checked_for_its_sign_and_range(override, field, says, make_cfg):
    with pytest.raises(ConfigError) as err:
        plan_run(make_cfg(override))
    (problem,) = [p for p in err.value.problems if p.startswith(field)]
    assert says in problem
    assert "lr_ablation.max_lr=-" not in problem.partition("must be")[2]  # no advice to set a negative rate


def test_the_vocabulary_is_checked_against_the_runs_own_tokenizer(make_cfg, tmp_path):
    from t6.data.tokenizer import load_tokenizer
    from t6.run.checks import vocabulary_problems

    from tiny_llama import VOCAB, save_llama_directory

    save_llama_directory(tmp_path / "llama")  # a pretrained model's tokenizer of VOCAB tokens, not GPT-2's 50,257
    with pytest.raises(ConfigError) as err:
        plan_run(make_cfg(f"tokenizer={tmp_path / 'llama'}", f"size.vocab_size={VOCAB - 1}"))
    (problem,) = [p for p in err.value.problems if p.startswith("size.vocab_size")]
    assert f"smaller than the tokenizer's {VOCAB} tokens" in problem and f"size.vocab_size>={VOCAB}" in problem
    cfg = make_cfg(f"tokenizer={tmp_path / 'llama'}", f"size.vocab_size={VOCAB}")
    assert vocabulary_problems(cfg, load_tokenizer(cfg.tokenizer)) == []  # its ids fit


def test_a_corpus_that_is_not_text_or_too_short_is_named(make_cfg, tmp_path):
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\u00e9 au lait\n".encode("latin-1") * 200)
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be, that is the question.\n" * 12)  # ~170 tokens: the last tenth < 65
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("Hello.\n")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    cases = [
        (binary, DamagedFile, rf"data.text_file='{binary}' is not text \(a NUL byte at offset 0"),
        (latin, DamagedFile, rf"data.text_file='{latin}' is not UTF-8 text \(byte 3"),
        (
            short,
            SettingError,
            rf"data.text_file={short}: its validation split holds \d+ tokens, fewer than one sequence",
        ),
        (tiny, SettingError, rf"data.text_file={tiny}: its training split holds \d+ tokens"),
        (empty, DamagedFile, rf"data.text_file='{empty}' holds no text"),  # it "held 1 tokens" (its end-of-text)
    ]
    for path, kind, says in cases:
        with pytest.raises(kind, match=says):
            plan_run(make_cfg(f"data.text_file={path}", f"paths.data_dir={tmp_path / 'shards'}"))
    assert not (tmp_path / "shards").exists()  # the plan wrote nothing


def test_directories_the_run_cannot_write_are_named(make_cfg, tmp_path):
    from omegaconf import open_dict

    cfg = make_cfg()
    with open_dict(cfg):
        cfg.paths.output_dir = "/proc/sys/t6-run"  # a file system this process may not write
    with pytest.raises(ConfigError) as err:
        plan_run(cfg)
    assert any(p.startswith("paths.output_dir=/proc/sys/t6-run: /proc/sys is not writable") for p in err.value.problems)
    fresh = tmp_path / "fresh"
    with pytest.raises(SettingError, match="data.data_dir=/proc/sys/t6-data: the shards of tinyshakespeare.txt"):
        plan_run(make_cfg(f"paths.data_dir={fresh}", "data.data_dir=/proc/sys/t6-data"))


def test_a_store_that_is_not_a_database_or_stays_locked_is_named(make_cfg, tmp_path, monkeypatch):
    import sqlite3

    from t6.tracking import mlflow as tracking

    store = tmp_path / "mlruns" / "mlflow.db"
    store.parent.mkdir()
    store.write_bytes(b"not a database" * 100)
    with pytest.raises(ValueError, match=f"{store} is not an SQLite database"):
        plan_run(make_cfg())
    store.unlink()
    sqlite3.connect(store).execute("CREATE TABLE t (x)").connection.commit()
    holder = sqlite3.connect(store, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process writing, for longer than the check waits
    monkeypatch.setattr(tracking, "STORE_WAIT_S", 0.5)
    try:
        with pytest.raises(ConnectionError, match=f"the MLflow store {store} is locked by another process"):
            plan_run(make_cfg())
    finally:
        holder.execute("ROLLBACK")


def training_checkpoint(cfg, path: Path, step: int, **changes) -> Path:
    """A training checkpoint of cfg's model at `step` (random weights), as RunCheckpoint writes one."""
    from dataclasses import asdict

    from t6.hydra_config import model_config
    from t6.training.module import T6LitModule

    fields = {**asdict(model_config(cfg)), **changes}
    module = T6LitModule(model_config=fields)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {"state_dict": module.state_dict(), "hyper_parameters": {"model_config": fields}, "global_step": step}, path
    )
    return path


def test_a_resume_checkpoint_must_hold_the_model_the_config_builds(make_cfg, tmp_path):
    cfg = make_cfg("attention=mha")
    tpa = training_checkpoint(make_cfg("attention=tpa"), tmp_path / "tpa.ckpt", 3)
    with pytest.raises(ValueError) as err:
        plan_run(make_cfg("attention=mha", f"ckpt_path={tpa}"))
    text = str(err.value)
    assert f"ckpt_path='{tpa}' holds a tpa model" in text and "this run's config does not build (mha)" in text
    assert "attention: 'tpa' in the checkpoint, 'mha' here" in text and "attention=tpa" in text
    holed = training_checkpoint(cfg, tmp_path / "holed.ckpt", 3)
    ckpt = torch.load(holed, weights_only=True)
    del ckpt["state_dict"]["model.blocks.0.attn.q.weight"]  # a tensor missing
    torch.save(ckpt, holed)
    with pytest.raises(ValueError, match=r"(?s)weights do not match its model config .*missing blocks.0.attn.q.weight"):
        plan_run(make_cfg("attention=mha", f"ckpt_path={holed}"))
    assert plan_run(make_cfg("attention=mha", f"ckpt_path={training_checkpoint(cfg, tmp_path / 'ok.ckpt', 3)}"))


def test_a_resume_takes_the_newest_whole_checkpoint(make_cfg, tmp_path):
    cfg = make_cfg("auto_resume=true")
    folder = Path(cfg.paths.output_dir) / "checkpoints"
    training_checkpoint(cfg, folder / "step000004.ckpt", 4)  # a crash before the last.ckpt beside it
    plan = plan_run(cfg)
    assert plan.resume.step == 4 and plan.resume.ckpt_path == str(folder / "step000004.ckpt")
    training_checkpoint(cfg, folder / "last.ckpt", 2)  # older than the periodic file
    assert plan_run(make_cfg("auto_resume=true")).resume.step == 4
    training_checkpoint(cfg, folder / "last.ckpt", 6)
    last = folder / "last.ckpt"
    assert plan_run(make_cfg("auto_resume=true")).resume.ckpt_path == str(last)
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # cut short (copied, or a full disk)
    plan = plan_run(make_cfg("ckpt_path=last"))
    assert plan.resume.step == 4 and "resume: passed over last.ckpt does not read whole" in " ".join(plan.warnings)
