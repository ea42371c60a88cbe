"""A mechanism added as the docs say, one Python file and one YAML file and nothing else (written here into a
temporary folder): the config composes it, the model builds, decodes with its own cache as it computes without
one, and every `match` criterion solves its sizes with no code that knows of it."""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest
import torch

from t6.hydra_config import store_attention_options, with_match
from t6.model import T6
from t6.model.attention import base
from t6.model.facts import kv_bytes_per_token, parameter_count
from t6.model.match import CRITERIA

from conftest import CONF, compose_config

NAME = "lowrank_v"

MECHANISM = '''
"""Multi-head attention whose values come through a rank-r bottleneck shared by the heads: v = W_up (W_down x).
Cached per token and layer: K (h d_h) and the bottleneck (r)."""

from dataclasses import dataclass

import torch
from torch import nn

from t6.model.attention.base import Attention, Options, register
from t6.model.layers import Rotary


@dataclass
class LowRankVOptions(Options):
    v_rank: int = 32  # r, the values' bottleneck


@register("lowrank_v")
class LowRankV(Attention):
    Options = LowRankVOptions

    def __init__(self, cfg):
        super().__init__(cfg)
        h, d = cfg.n_head, cfg.head_dim
        self.q = nn.Linear(cfg.d_model, h * d, bias=False)
        self.k = nn.Linear(cfg.d_model, h * d, bias=False)
        self.v_down = nn.Linear(cfg.d_model, self.opts.v_rank, bias=False)
        self.v_up = nn.Linear(self.opts.v_rank, h * d, bias=False)
        self.out = nn.Linear(h * d, cfg.d_model, bias=False)
        self.rope = Rotary(d, cfg.block_size, cfg.rope_theta)

    def cache_spec(self):
        return {"k": (self.cfg.n_head, self.cfg.head_dim), "c": (self.opts.v_rank,)}

    def forward(self, x, pos, cache=None):
        B, T, _ = x.shape
        h, d = self.cfg.n_head, self.cfg.head_dim
        q = self.rope(self.q(x).view(B, T, h, d), pos)  # [B, T, h, d]
        k = self.rope(self.k(x).view(B, T, h, d), pos)  # [B, T, h, d]
        c = self.v_down(x)  # [B, T, r]
        if cache is not None:
            k, c = cache.update(pos, k=k, c=c)  # [B, S, h, d], [B, S, r]
        v = self.v_up(c).view(B, c.shape[1], h, d)  # [B, S, h, d]
        y = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), pos, cache)  # [B, h, T, d]
        return self.project(y.transpose(1, 2).reshape(B, T, h * d), x)  # [B, T, d_model]
'''

CONFIG = """
defaults:
  - /attention_options/lowrank_v@options
  - _self_
name: lowrank_v
heads: {tiny: 5, small: 14, medium: 19, large: 24, xl: 30}
"""


@pytest.fixture
def added(tmp_path, monkeypatch):
    """The mechanism's file imported (it registers itself) and its YAML beside a copy of conf/attention: the
    overrides that compose it. The registry forgets it after the test."""
    (tmp_path / f"{NAME}.py").write_text(textwrap.dedent(MECHANISM))
    conf = tmp_path / "conf" / "attention"
    conf.mkdir(parents=True)
    (conf / f"{NAME}.yaml").write_text(CONFIG)
    spec = importlib.util.spec_from_file_location(f"t6_extension_{NAME}", tmp_path / f"{NAME}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    monkeypatch.setitem(base.registry, NAME, None)  # absent before: the registry forgets it at teardown
    del base.registry[NAME]
    spec.loader.exec_module(module)  # @register("lowrank_v")
    store_attention_options()
    return [f"attention={NAME}", f"hydra.searchpath=[file://{tmp_path / 'conf'}]"]


def test_a_mechanism_of_one_file_and_one_yaml_builds_decodes_and_is_matched_by_every_criterion(added, tmp_path):
    cfg = compose_config(added, tmp_path)
    assert cfg.attention.options.v_rank == 32 and cfg.size.n_head == 5 and (CONF / "attention").is_dir()
    model = T6(with_match(cfg)[1].model).eval()
    idx = torch.randint(0, model.cfg.vocab_size, (1, 12))
    caches = model.build_kv_caches(1, 12)
    with torch.no_grad():
        steps = [model(idx[:, :5], 0, caches)] + [model(idx[:, t : t + 1], t, caches) for t in range(5, 12)]
        torch.testing.assert_close(torch.cat(steps, dim=1), model(idx), rtol=1e-4, atol=1e-4)
    assert model.blocks[0].attn.cache_spec() == {"k": (5, 64), "c": (32,)}
    for criterion in CRITERIA:
        cfg, m = with_match(compose_config([*added, f"match={criterion}"], tmp_path))
        assert cfg.attention.name == NAME and (cfg.size.n_head, cfg.attention.options.v_rank) == (
            m.model.n_head,
            m.model.attention_options["v_rank"],
        )
        assert abs(m.gap()) <= 0.01 + 1e-9, m.describe()  # heads and v_rank reach every quantity of MHA's
        assert m.quantities(m.model, flops=False)["params"] == parameter_count(m.model)
        assert m.quantities(m.model, flops=False)["kv_bytes"] == kv_bytes_per_token(m.model)
    assert m.changes() and abs(m.gap("params")) <= 0.01 + 1e-9  # flops: the parameters held too
