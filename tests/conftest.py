"""Shared fixtures: the real Hydra config, composed and shrunk to CPU-test size."""

from __future__ import annotations

import functools
import json
import os
import shutil
import sqlite3
import sys
import tempfile
from contextlib import closing
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from t6.cli import register

register()  # as every entry script does before Hydra composes

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
# third-party test modules the project's tests import (transformers' model tests), never collected themselves
collect_ignore = ["third_party"]
THIRD_PARTY_MARKERS = ["accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test"]
THIRD_PARTY_MARKERS += ["torch_compile_test"]


def pytest_configure(config):
    for marker in THIRD_PARTY_MARKERS:  # the markers of transformers' model tests (tests/third_party), registered
        config.addinivalue_line("markers", f"{marker}: transformers' own marker (tests/third_party)")
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")  # set in each worker of `pytest -n N` (make test)
    if workers:  # each worker's torch gets its share of the cores: N workers x all cores would oversubscribe them
        import torch

        share = max(1, len(os.sched_getaffinity(0)) // int(workers))
        torch.set_num_threads(share)
        os.environ["OMP_NUM_THREADS"] = str(share)  # and so do the processes a test starts (train.py, torchrun's ranks)


def pytest_collection_modifyitems(config, items):
    """The slow tests first, the longest first by the last measured run (experiments/ci/: a test's own seconds
    where it is among the slowest listed, else its file's mean): pytest-xdist deals the tests out in this order, so
    the long ones start early and the short ones fill the workers' ends (one long test dealt last would run alone
    on an otherwise idle machine)."""
    table = ROOT / "experiments" / "ci" / "make_test_2core.json"
    measured = json.loads(table.read_text()) if table.is_file() else {"files": [], "records": []}
    mean = {f["file"]: f["seconds"] / f["tests"] for f in measured["files"]}
    own = {f"{r['file']}::{r['test']}": r["seconds"] for r in measured["records"]}

    def seconds(item) -> float:
        return own.get(item.nodeid, mean.get(item.nodeid.split("::")[0], 0.0))

    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, -seconds(item)))


# A model small enough for a CPU test step in well under a second, with the real vocabulary.
TEST_SIZE = ["size=tiny", "size.n_layer=2", "size.d_model=64", "size.block_size=64"]
TEST_RUN = [
    "data.batch_size=4",
    "data.global_batch_size=null",  # no accumulation unless a test asks for it
    "trainer.max_steps=8",
    "trainer.precision=32-true",  # fp32 on every CPU (auto picks bf16-mixed where the CPU has AMX bf16)
    "trainer.val_check_interval=4",
    "trainer.log_every_n_steps=1",
    "data.val_windows=8",
    "callbacks.rich_model_summary=null",
    "callbacks.model_checkpoint.every_n_train_steps=4",
    "logger.mlflow.log_model=false",
    "print_config=false",
    "auto_resume=false",  # tests reuse one run dir; resume only where a test asks for it
    "trainer.accelerator=cpu",  # CPU tests on any machine, a CUDA one too (dropped where a test picks trainer=...)
]


# torch.compile's cache for the tests' runs: shared by every test and session on the machine (a run's own default,
# <root>/.cache/compile, would be a new tmp_path each time, so every compiling test would compile from scratch).
TEST_COMPILE_CACHE = Path(tempfile.gettempdir()) / "t6-tests-compile-cache"


def compose_config(overrides: list[str], root: Path, config_name: str = "train") -> DictConfig:
    """Compose conf/<config_name>.yaml as `python train.py <overrides>` would, with all paths under root."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # lets ${hydra:...} resolve outside @hydra.main
    with open_dict(cfg):
        del cfg["hydra"]  # as in @hydra.main, the job's config has no hydra node
        cfg.paths.root_dir = str(root)
        cfg.paths.output_dir = str(root / "run")
        if not any(o.startswith("paths.compile_cache_dir=") for o in overrides):
            cfg.paths.compile_cache_dir = str(TEST_COMPILE_CACHE)  # one across the tests' runs, as across a user's
    return cfg


def random_model(tmp_path: Path, *overrides: str, seed: int = 0):
    """A small real model (size=tiny shrunk to 2 layers x 128, block 64) built from the composed
    config, with random weights everywhere (the zero-initialized residual outputs too), in eval mode."""
    import torch

    from t6.hydra_config import model_config
    from t6.model import T6

    base = ["size=tiny", "size.n_layer=2", "size.d_model=128", "size.block_size=64"]
    cfg = model_config(compose_config([*base, *overrides], tmp_path))
    torch.manual_seed(seed)
    model = T6(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model.eval()


def assert_cached_decoding_equals_full_forward(model, length: int = 24, prefill: int = 10) -> None:
    """The model's logits over `length` random tokens, computed at once and through its KV caches (a prefill, then
    token by token, then a chunk against the cache), are the same."""
    import torch

    idx = torch.randint(0, model.cfg.vocab_size, (2, length))
    full = model(idx)  # [B, T, V]
    caches = model.build_kv_caches(2, length + 8)
    parts = [model(idx[:, :prefill], 0, caches)]  # prefill
    parts += [model(idx[:, t : t + 1], t, caches) for t in range(prefill, length - 4)]  # token by token
    parts.append(model(idx[:, length - 4 :], length - 4, caches))  # a chunk against the cache
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-4)


def tiny_model_config(tmp_path: Path, attention: str, *overrides: str):
    """The ModelConfig of a very small T6 of `attention` (2 layers x 32, head_dim 16, block 64, 99 tokens),
    the mechanism's options and head count as its config gives them."""
    from t6.hydra_config import model_config

    base = ["size=tiny", "size.n_layer=2", "size.d_model=32", "size.head_dim=16", "size.block_size=64"]
    return model_config(compose_config([*base, "size.vocab_size=99", f"attention={attention}", *overrides], tmp_path))


@pytest.fixture(scope="session")
def hf_classes(tmp_path_factory):
    """(T6Config, T6ForCausalLM) as transformers loads them from a directory export.py wrote (remote code,
    the same files for every mechanism): the export's own classes, not t6.hf's."""
    from dataclasses import asdict

    import torch
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from t6.hf.export import write_export
    from t6.model import T6

    root = tmp_path_factory.mktemp("hf_classes")
    model = T6(tiny_model_config(root, "mha"))
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "hyper_parameters": {"model_config": asdict(model.cfg)}}, root / "last.ckpt")
    _, out = write_export(root / "last.ckpt", root / "t6")
    return tuple(
        get_class_from_dynamic_module(f"{module}.{name}", out)
        for module, name in (("configuration_t6", "T6Config"), ("modeling_t6", "T6ForCausalLM"))
    )


def hf_config(config_class, cfg, **extra):
    """An exported T6Config of the ModelConfig cfg, its token ids inside the vocabulary."""
    from dataclasses import asdict

    ids = {k: cfg.vocab_size - 1 for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return config_class(**{**asdict(cfg), **ids, **extra})


@pytest.fixture(scope="session")
def shared_data_dir(tmp_path_factory) -> Path:
    """One tokenization of the embedded corpus for the whole session."""
    return tmp_path_factory.mktemp("data")


@functools.cache
def empty_store() -> Path:
    """An empty MLflow SQLite store, its schema made once per test process: MLflow's migrations take ~3 s for each
    new store, which most tests that train would otherwise pay."""
    import mlflow

    path = Path(tempfile.mkdtemp(prefix="t6-tests-store-")) / "mlflow.db"
    mlflow.MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()  # creates and migrates it
    return path


@pytest.fixture(scope="session", autouse=True)
def _remove_the_empty_store():
    yield
    if empty_store.cache_info().currsize:
        shutil.rmtree(empty_store().parent, ignore_errors=True)


def seed_store(db: Path) -> None:
    """Unless db exists, it starts as a copy of the empty store (SQLite's backup: a consistent copy): the store
    MLflow would make there on the run's first write, without its migrations."""
    if db.exists():
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with closing(sqlite3.connect(empty_store())) as source, closing(sqlite3.connect(db)) as target:
        source.backup(target)


@pytest.fixture
def make_cfg(tmp_path, shared_data_dir, monkeypatch):
    """make_cfg(*overrides) -> a test-sized training config writing under tmp_path, its MLflow store there made
    already (seed_store; store=False leaves none, for a test that checks nothing was tracked)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    def make(*overrides: str, config_name: str = "train", small: bool = True, store: bool = True) -> DictConfig:
        base = [*TEST_SIZE, *TEST_RUN] if small else []
        if any(o.startswith("trainer=") for o in overrides):  # that trainer's own accelerator (gpu, ddp, fsdp)
            base = [o for o in base if not o.startswith("trainer.accelerator=")]
        if small and not any(o.startswith("eval") for o in overrides):
            base.append("eval=none")  # downstream evaluation only where a test asks for it
        cfg = compose_config([*base, *overrides], tmp_path, config_name)
        with open_dict(cfg):
            cfg.paths.data_dir = str(shared_data_dir)
        if store:
            seed_store(Path(cfg.paths.mlflow_dir) / "mlflow.db")
        return cfg

    return make


@pytest.fixture(autouse=True)
def _accelerators_untried():
    """Each test starts with every accelerator untried (t6.model.fallback remembers a failure for the process)."""
    from t6.model import fallback

    fallback.reset()
    yield
    fallback.reset()
    log = sys.modules.get("t6.training.callbacks.fallbacks")  # a run's listener goes with its run
    if log is not None and log.FallbackLog.stop_listening is not None:
        log.FallbackLog.stop_listening()
        log.FallbackLog.stop_listening = None


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    monkeypatch.setenv("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
