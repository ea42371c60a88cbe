"""Every option of every config group composes and resolves; bad configs fail early and clearly."""

from __future__ import annotations

import pytest
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

from t6.errors import ConfigError
from t6.hydra_config import model_config
from t6.model import T6, ModelConfig

from conftest import CONF, compose_config

TRAIN_GROUPS = {
    next(iter(d)) for d in yaml.safe_load((CONF / "train.yaml").read_text())["defaults"] if isinstance(d, dict)
}
# `dataset` is prepare.py's group; train.yaml lists it (null) only so that `train.py dataset=...` gets a clear error
GROUPS = sorted(
    p.name for p in CONF.iterdir() if p.is_dir() and p.name not in ("hydra", "dataset") and p.name in TRAIN_GROUPS
)
# experiment recipes compose in tests/test_experiments.py, with the checks of what each reproduces
OPTIONS = [(g, f.stem) for g in GROUPS if g != "experiment" for f in sorted((CONF / g).glob("*.yaml"))]


def test_every_group_has_options():
    assert {
        "attention",
        "size",
        "optimizer",
        "lr_ablation",
        "data",
        "trainer",
        "logger",
        "callbacks",
        "eval",
        "paths",
    } <= set(GROUPS)
    assert all(any(g == group for g, _ in OPTIONS) for group in GROUPS if group != "experiment")


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_and_resolves(group, option, tmp_path):
    cfg = compose_config([f"{group}={option}"], tmp_path)
    assert HydraConfig.get().runtime.choices[group] == option
    if "???" in (CONF / group / f"{option}.yaml").read_text():  # a recipe with a required input (experiment=uptrain)
        with pytest.raises((MissingMandatoryValue, InterpolationResolutionError), match="init_from"):  # asks for it
            OmegaConf.resolve(cfg)
        return
    OmegaConf.resolve(cfg)  # every interpolation resolves
    mcfg = model_config(cfg)
    assert isinstance(mcfg, ModelConfig) and mcfg.attention == cfg.attention.name


def test_unknown_option_lists_choices(tmp_path):
    with pytest.raises(ConfigCompositionException) as err:
        compose_config(["attention=nope"], tmp_path)
    assert "Could not find 'attention/nope'" in str(err.value) and "tpa" in str(err.value)


def test_user_head_override_wins(tmp_path):
    cfg = compose_config(["attention=tpa", "size=medium", "size.n_head=40"], tmp_path)
    assert model_config(cfg).n_head == 40
    assert model_config(compose_config(["attention=tpa", "size=medium"], tmp_path)).n_head == 47


def test_cross_field_errors_name_every_field(tmp_path):
    cfg = compose_config(
        ["attention=tpa", "attention.options.k_rank=0", "size.head_dim=63", "size.n_layer=-1"], tmp_path
    )
    with pytest.raises(ConfigError) as err:
        model_config(cfg)
    assert err.value.problems == [  # every problem at once, named as the command line names them
        "size.n_layer=-1 must be a positive integer",
        "size.head_dim=63 must be even (RoPE rotates pairs of dimensions)",
        "attention.options.k_rank=0 must be a positive integer",
    ]
    with pytest.raises(ValueError, match=r"attention.options.k_rank=0 must be a positive integer"):
        model_config(compose_config(["attention=tpa", "attention.options.k_rank=0"], tmp_path))
    with pytest.raises(ValueError, match=r"n_head=6 must be divisible by attention.options.n_kv_head=4"):
        ModelConfig(attention="gqa", n_head=6, attention_options={"n_kv_head": 4})


def test_model_builds_from_composed_config(tmp_path):
    cfg = compose_config(["attention=mha", "size=small"], tmp_path)
    with __import__("torch").device("meta"):
        model = T6(model_config(cfg))
    assert model.cfg.n_layer == 12 and model.cfg.d_model == 768 and model.cfg.n_head == 12


def test_mechanism_options_are_typed_with_presets_and_every_model_field_is_reachable(tmp_path):
    def build(*overrides):
        return model_config(compose_config(list(overrides), tmp_path))

    assert build("attention=tpa", "attention.options.k_rank=4").options().k_rank == 4  # no `+` needed
    assert build("attention=tpa_kvonly").options().q_rank is None  # the preset: a standard query
    with pytest.raises(ValueError, match=r"attention.options.n_kv_head=2: attention=mha fixes it to None"):
        build("attention=mha", "attention.options.n_kv_head=2")
    with pytest.raises(ValueError, match=r"attention.options.k_rnak is not an option of attention=tpa"):
        build("attention=tpa", "+attention.options.k_rnak=2")
    assert build("+size.rope_theta=500000").rope_theta == 500000
    assert build("+size.tie_embeddings=false").tie_embeddings is False
    with pytest.raises(ValueError, match=r"size.rope_thetaa is not a model setting \(did you mean size.rope_theta\?\)"):
        build("+size.rope_thetaa=500000")
