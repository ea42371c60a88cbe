"""Shared fixtures: the real Hydra config, composed and shrunk to CPU-test size."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from t6.run.cli import register

register()  # as every entry script does before Hydra composes

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

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
    return cfg


def random_model(tmp_path: Path, *overrides: str, seed: int = 0):
    """A small real model (size=tiny shrunk to 2 layers x 128, block 64) built from the composed
    config, with random weights everywhere (the zero-initialized residual outputs too), in eval mode."""
    import torch

    from t6.config import model_config
    from t6.model import T6

    base = ["size=tiny", "size.n_layer=2", "size.d_model=128", "size.block_size=64"]
    cfg = model_config(compose_config([*base, *overrides], tmp_path))
    torch.manual_seed(seed)
    model = T6(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model.eval()


@pytest.fixture(scope="session")
def shared_data_dir(tmp_path_factory) -> Path:
    """One tokenization of the embedded corpus for the whole session."""
    return tmp_path_factory.mktemp("data")


@pytest.fixture
def make_cfg(tmp_path, shared_data_dir, monkeypatch):
    """make_cfg(*overrides) -> a test-sized training config writing under tmp_path."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    def make(*overrides: str, config_name: str = "train", small: bool = True) -> DictConfig:
        base = [*TEST_SIZE, *TEST_RUN] if small else []
        if any(o.startswith("trainer=") for o in overrides):  # that trainer's own accelerator (gpu, ddp, fsdp)
            base = [o for o in base if not o.startswith("trainer.accelerator=")]
        if small and not any(o.startswith("eval") for o in overrides):
            base.append("eval=none")  # downstream evaluation only where a test asks for it
        cfg = compose_config([*base, *overrides], tmp_path, config_name)
        with open_dict(cfg):
            cfg.paths.data_dir = str(shared_data_dir)
        return cfg

    return make


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    monkeypatch.setenv("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
