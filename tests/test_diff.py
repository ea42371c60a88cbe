"""Differential attention (src/t6/model/attention/diff.py) against the DIFF Transformer's equations written out
(arXiv 2410.05258 V1): two softmax maps subtracted with the re-parameterized lambda, lambda_init by depth, the
per-head RMSNorm and the (1 - lambda_init) scale."""

from __future__ import annotations

import math

import pytest
import torch

from t6.model.attention.diff import lambda_init_at

from conftest import random_model


def written_out(attn, x: torch.Tensor) -> torch.Tensor:
    """The layer's output for x [1, T, d_model] from the paper's formulas, each map an explicit causal softmax."""
    T, h, d = x.shape[1], attn.cfg.n_head, attn.cfg.head_dim
    pos = torch.arange(T)
    q = attn.rope(attn.q(x).view(1, T, 2, h, d).flatten(2, 3), pos).view(1, T, 2, h, d)  # [1, T, 2, h, d]
    k = attn.rope(attn.k(x).view(1, T, 2, h, d).flatten(2, 3), pos).view(1, T, 2, h, d)
    v = attn.v(x).view(1, T, h, 2 * d)  # [1, T, h, 2d]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    lam_init = 0.8 - 0.6 * math.exp(-0.3 * attn.depth)
    lam = math.exp(attn.lambda_q1 @ attn.lambda_k1) - math.exp(attn.lambda_q2 @ attn.lambda_k2) + lam_init
    heads = []
    for i in range(h):
        maps = []
        for j in range(2):
            scores = (q[0, :, j, i] @ k[0, :, j, i].T) / math.sqrt(d)  # [T, T]
            maps.append(scores.masked_fill(~causal, float("-inf")).softmax(-1))
        head = (maps[0] - lam * maps[1]) @ v[0, :, i]  # [T, 2d]
        heads.append((1 - lam_init) * head * torch.rsqrt(head.pow(2).mean(-1, keepdim=True) + attn.cfg.norm_eps))
    y = torch.cat(heads, dim=-1) * attn.head_norm.weight.repeat(h)  # [T, h 2d], RMSNorm's weight per head
    return attn.out(y)[None]  # [1, T, d_model]


@pytest.mark.parametrize("depth", [0, 3])
def test_the_layer_computes_the_papers_equations(depth, tmp_path):
    model = random_model(tmp_path, "attention=diff", "size.n_layer=4", "size.vocab_size=512", seed=3)
    attn = model.blocks[depth].attn
    with torch.no_grad():
        attn.lambda_q1.mul_(4.0)  # lambda away from lambda_init, so the subtraction is tested
        x = torch.randn(1, 10, model.cfg.d_model)
        torch.testing.assert_close(attn(x, torch.arange(10)), written_out(attn, x), rtol=1e-4, atol=1e-5)


def test_lambda_init_follows_the_depth_and_the_heads_match_mhas_parameters(tmp_path):
    """lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1)) for layers l = 1..L (index 0..L-1); a constant when given. Each
    head's two d_h maps and 2 d_h value make h DIFF heads the projections of 2h MHA heads."""
    model = random_model(tmp_path, "attention=diff", "size.n_layer=4", "size.vocab_size=512")
    schedule = [0.8 - 0.6 * math.exp(-0.3 * i) for i in range(4)]
    assert [b.attn.lambda_init_value.item() for b in model.blocks] == pytest.approx(schedule)  # what forward reads
    assert lambda_init_at(0) == pytest.approx(0.2) and lambda_init_at(40) == pytest.approx(0.8, abs=1e-5)
    fixed = random_model(tmp_path, "attention=diff", "attention.options.lambda_init=0.5", "size.vocab_size=512")
    assert {b.attn.lambda_init_value.item() for b in fixed.blocks} == {0.5}
    mha = random_model(tmp_path, "attention=mha", "size.n_head=4", "size.vocab_size=512")
    diff = model.blocks[0].attn
    extra = 4 * diff.cfg.head_dim + 2 * diff.cfg.head_dim  # the lambda vectors and the head norm
    assert sum(p.numel() for p in diff.parameters()) == sum(p.numel() for p in mha.blocks[0].attn.parameters()) + extra
