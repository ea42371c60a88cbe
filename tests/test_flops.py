"""t6.model.facts.flops_per_token against the closed form, and the loader benchmark end to end."""

from __future__ import annotations

import json

import pytest

from t6.model import T6, ModelConfig
from t6.model.facts import flops_per_token


@pytest.mark.parametrize("seq_len", [16, 32])
def test_flops_per_token_is_6n_plus_attention(seq_len):
    cfg = ModelConfig(vocab_size=512, block_size=64, n_layer=2, d_model=64, n_head=4, head_dim=16, attention="mha")
    model = T6(cfg)
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)  # block matrices + tied embedding/head
    attention = 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len  # QK^T and AV: 2 x 2 T D each, fwd + 2x bwd
    assert flops_per_token(model, seq_len) == 6 * matrices + attention
    assert all(p.grad is None for p in model.parameters())  # the count leaves no gradients behind


def test_loader_benchmark_reports_both_rates(tmp_path, shared_data_dir, monkeypatch):
    from t6.bench import loader

    out = tmp_path / "loader.json"
    result = loader.main(
        [
            "--batches",
            "20",
            "--steps",
            "2",
            "--json",
            str(out),
            f"paths.root_dir={tmp_path}",
            f"paths.data_dir={shared_data_dir}",
            "size.n_layer=2",
            "size.d_model=64",
            "size.block_size=64",
            "data.batch_size=4",
        ]
    )
    assert json.loads(out.read_text())["records"] == [result]
    assert result["loader_tokens_per_s"] > 0 and result["train_step_tokens_per_s"] > 0
    assert result["loader_over_step"] == pytest.approx(
        result["loader_tokens_per_s"] / result["train_step_tokens_per_s"]
    )
