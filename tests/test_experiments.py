"""conf/experiment/*.yaml: every recipe composes into the paper's settings and documents itself."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from t6.hydra_config import model_config
from t6.model import T6
from t6.model.attention import PAPER as PAPER_SIX

from conftest import CONF

RECIPES = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
PAPER = {
    "paper_small": ("small", 6e-4, 3e-5),
    "paper_medium": ("medium", 3e-4, 3e-5),
    "paper_large": ("large", 2e-4, 1e-5),
    "paper_xl": ("xl", 2e-4, 1e-5),
    "lr_ablation_medium": ("medium", 6e-4, 3e-5),
}
SIX = list(PAPER_SIX)


def compose_recipe(name: str, *overrides: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=[f"experiment={name}", *overrides], return_hydra_config=True)


SINGLE_RUN = {"uptrain"}  # recipes that continue one given checkpoint rather than sweep attentions


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_documents_itself(name):
    text = (CONF / "experiment" / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_\n")
    for word in ("Reproduces:", "Hardware:", "Expected duration:"):
        assert word in text, f"conf/experiment/{name}.yaml lacks a '{word}' comment"
    if name not in SINGLE_RUN:  # the paper's studies sweep the six attentions, and others join by an override
        assert compose_recipe(name).hydra.sweeper.params.attention.split(",") == SIX
        joined = compose_recipe(name, "compare=[paper,tpa_nc_a]").hydra.sweeper.params.attention
        assert joined.split(",") == [*SIX, "tpa_nc_a"]


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_recipes_have_the_papers_recipe(name):
    size, max_lr, min_lr = PAPER[name]
    cfg = compose_recipe(name)
    assert cfg.size.name == size and cfg.size.block_size == 1024 and cfg.data.seq_len == 1024
    assert cfg.optimizer._target_ == "torch.optim.AdamW" and list(cfg.optimizer.betas) == [0.9, 0.95]
    assert cfg.optimizer.weight_decay == 0.1 and cfg.trainer.gradient_clip_val == 1.0
    assert (cfg.lr_ablation.max_lr, cfg.lr_ablation.min_lr, cfg.lr_ablation.warmup_steps) == (max_lr, min_lr, 2000)
    assert cfg.data.global_batch_size == 480 and 480 % cfg.trainer.devices == 0 and cfg.data.batch_size == "auto"
    tokens = cfg.data.global_batch_size * cfg.data.seq_len * cfg.trainer.max_steps
    assert cfg.trainer.max_steps == 100_000 and 49e9 < tokens < 51e9
    assert cfg.hydra.sweeper.params.attention.split(",") == SIX


@pytest.mark.parametrize("name", [n for n in PAPER if n.startswith("paper_")])
def test_paper_recipes_checkpoint_at_recipe_scale(name):
    ckpt = compose_recipe(name).callbacks.model_checkpoint
    assert ckpt.every_n_train_steps >= 1000 and ckpt.save_last == "link"


@pytest.mark.slow  # trains, then resumes (~6 s)
def test_last_link_points_at_the_newest_checkpoint_and_resumes(make_cfg, tmp_path):
    from t6.run.train import main as train

    overrides = [
        "callbacks.model_checkpoint.save_last=link",
        "trainer.max_steps=4",
        "callbacks.model_checkpoint.every_n_train_steps=2",
    ]
    train(make_cfg(*overrides))
    ckpts = tmp_path / "run" / "checkpoints"
    last = ckpts / "last.ckpt"
    assert last.is_symlink() and last.resolve() == (ckpts / "step000004.ckpt").resolve()
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step000004.ckpt"]  # one full copy on disk
    _, objects = train(
        make_cfg(
            *overrides[:1],
            "trainer.max_steps=6",
            "auto_resume=true",
            "callbacks.model_checkpoint.every_n_train_steps=2",
        )
    )
    assert objects["trainer"].global_step == 6 and last.resolve() == (ckpts / "step000006.ckpt").resolve()


def test_cpu_comparison_sweeps_six_attentions_and_three_seeds_at_one_budget():
    spec = OmegaConf.load(CONF / "experiment" / "cpu_comparison.yaml")
    assert compose_recipe("cpu_comparison").hydra.sweeper.params.attention.split(",") == SIX
    assert len(str(spec.hydra.sweeper.params.seed).split(",")) >= 3
    assert {"override /eval": "local"} in spec.defaults
    tokens, params = {}, {}
    for attention in SIX:
        cfg = compose_recipe("cpu_comparison", f"attention={attention}")
        assert cfg.size.name == "tiny" and cfg.data.embedded and cfg.experiment_name == "cpu_comparison"
        tokens[attention] = cfg.trainer.max_steps * cfg.data.batch_size * cfg.data.seq_len
        params[attention] = T6(model_config(cfg)).num_params(non_embedding=True)
    assert set(tokens.values()) == {100 * 8 * 256}
    for attention, n in params.items():  # the tiny head counts keep every mechanism near MHA's size
        assert abs(n / params["mha"] - 1) < 0.1, f"{attention}: {n} non-embedding parameters vs mha {params['mha']}"


def test_a_recipes_declared_sweep_names_its_child_runs():
    from t6.tracking.sweep import swept_keys

    cfg = compose_recipe("cpu_comparison")
    keys = swept_keys(["trainer.max_steps=5", "size=tiny"], cfg.hydra.sweeper.params)
    assert keys == ["attention", "seed"]  # what varies, so each child run is named "attention=mha seed=1"
    assert swept_keys(["attention=mha,tpa", "seed=1"], {"seed": "1,2"}) == ["seed", "attention"]
    assert swept_keys(["attention=mha"], {}) == []


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_runs_without_tracking(name):
    """`experiment=NAME logger=none`: a recipe's own `logger.mlflow.*` settings leave no half logger behind."""
    from hydra.core.hydra_config import HydraConfig

    from t6.run.sections import MLflowSettings, components

    for overrides, tracked in ((["logger=none"], False), ([], True)):  # and with the default logger it is one
        cfg = compose_recipe(name, *overrides)
        HydraConfig.instance().set_config(cfg)  # ${hydra:runtime.output_dir} resolves, as under @hydra.main
        assert (MLflowSettings.read(cfg.get("logger")) is not None) is tracked
        assert len(components(cfg.get("logger"))) == tracked


def test_a_recipe_trains_with_logger_none(tmp_path, shared_data_dir, monkeypatch):
    from omegaconf import open_dict

    from t6.run.train import main as train

    from conftest import TEST_RUN, TEST_SIZE, compose_config

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = [o for o in TEST_RUN if not o.startswith("logger.")] + ["trainer.max_steps=3", "trainer.val_check_interval=3"]
    cfg = compose_config(["experiment=cpu_comparison", "logger=none", "eval=none", *TEST_SIZE, *run], tmp_path)
    with open_dict(cfg):
        cfg.paths.data_dir = str(shared_data_dir)
    metrics, objects = train(cfg)
    assert objects["mlflow"] is None and objects["trainer"].global_step == 3 and "val/loss" in metrics
    assert not (tmp_path / "mlruns").exists()
