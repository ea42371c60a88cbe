"""Mathematical properties of the backbone, for every registered attention mechanism (cached decoding
against generation and caches: tests/test_inference.py)."""

from __future__ import annotations

import pytest
import torch

from t6.model import T6, ModelConfig
from t6.model.attention import available
from t6.model.layers import Rotary

from conftest import assert_cached_decoding_equals_full_forward, random_model

ATTENTIONS = available()


def tiny_model(attention: str, tmp_path, seed: int = 0, **size) -> T6:
    return random_model(tmp_path, f"attention={attention}", *(f"size.{k}={v}" for k, v in size.items()), seed=seed)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_cached_decoding_equals_full_forward(attention, tmp_path):
    assert_cached_decoding_equals_full_forward(tiny_model(attention, tmp_path))


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_compiled_blocks_are_one_whole_graph_and_compute_the_same(attention, tmp_path):
    """T6.compile_blocks, what training compiles: every block through one graph (the blocks share it),
    without a graph break (fullgraph), forward and backward as eager; calls with a cache stay eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    eager, compiled = tiny_model(attention, tmp_path).train(), tiny_model(attention, tmp_path).train()
    counter = CompileCounterWithBackend("aot_eager")
    compiled.compile_blocks(backend=counter)
    idx = torch.randint(0, eager.cfg.vocab_size, (2, 16))
    losses = [m(idx[:, :-1], targets=idx[:, 1:]) for m in (eager, compiled)]
    for loss in losses:
        loss.backward()
    assert counter.frame_count == 1  # one graph for both blocks
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for p, q in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        compiled(idx[:, :4], 0, compiled.build_kv_caches(2, 8))  # a prefill through the cache: eager
    assert counter.frame_count == 1


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.slow  # compiles every mechanism's block (~1 s each)
def test_a_block_compiles_whole_for_any_length(attention, tmp_path):
    """A block compiled with dynamic shapes (what dynamo turns to when one process compiles the same code for a
    second length) is one graph for every sequence length, with no graph break, and computes as eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    block = tiny_model(attention, tmp_path).blocks[0]
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(block.layers, backend=counter, fullgraph=True, dynamic=True)
    for T in (8, 12):
        x = torch.randn(2, T, block.attn_norm.weight.shape[0])  # [B, T, d]
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, torch.arange(T)), block.layers(x, torch.arange(T)))
    assert counter.frame_count == 1


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_causal(attention, tmp_path):
    model = tiny_model(attention, tmp_path)
    idx = torch.randint(0, model.cfg.vocab_size, (1, 20))
    changed = idx.clone()
    changed[0, 12] = (idx[0, 12] + 1) % model.cfg.vocab_size
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=0)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_rope_dot_products_depend_only_on_relative_position():
    rope = Rotary(64, 128)
    q, k = torch.randn(1, 1, 1, 64), torch.randn(1, 1, 1, 64)

    def score(m, n):
        return (rope(q, torch.tensor([m])) * rope(k, torch.tensor([n]))).sum()

    torch.testing.assert_close(score(10, 3), score(50, 43), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(score(10, 3), score(10, 4))


@pytest.mark.parametrize("attention", ["tpa", "tpa_kvonly"])
def test_tpa_logits_invariant_to_position_shift(attention, tmp_path):
    """Paper Theorem 1: with RoPE on B_Q and B_K, q_m . k_n depends on m - n only, so
    shifting every position by a constant leaves the attention output unchanged."""
    model = tiny_model(attention, tmp_path)
    x = torch.randn(2, 16, model.cfg.d_model)
    attn = model.blocks[0].attn
    base = attn(x, torch.arange(16))
    shifted = attn(x, torch.arange(16) + 37)
    torch.testing.assert_close(base, shifted, rtol=1e-4, atol=1e-5)


def test_generation_past_block_size_is_a_clear_error(tmp_path):
    model = tiny_model("tpa", tmp_path)
    with pytest.raises(ValueError, match="exceeds block_size 64"):
        model.generate(torch.zeros(1, 60, dtype=torch.long), 10)


def test_tied_embedding_and_zero_init_residuals():
    model = T6(ModelConfig(attention="tpa", n_layer=2, d_model=64, n_head=2, vocab_size=1000, block_size=32))
    assert model.lm_head.weight is model.embed.weight
    assert all(b.attn.out.weight.abs().sum() == 0 and b.ffn.down.weight.abs().sum() == 0 for b in model.blocks)
    assert model.num_params() == sum(p.numel() for p in set(model.parameters()))
