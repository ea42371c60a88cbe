"""The output gate (attention.options.output_gate, Attention.project) of every registered mechanism: what it
computes, its parameters, cached decoding and the Hugging Face export of a gated model."""

from __future__ import annotations

import pytest
import torch
from test_export import load_hf, save_training_checkpoint

from t6.hf.export import write_export
from t6.model.attention import available
from t6.model.facts import parameter_count

from conftest import assert_cached_decoding_equals_full_forward, random_model

ATTENTIONS = available()


@pytest.mark.parametrize(
    "attention, kind",
    [(a, "elementwise") for a in ATTENTIONS] + [(a, "headwise") for a in ("gqa", "mla", "tpa", "diff")],
)
def test_the_gate_multiplies_each_heads_output_before_the_projection(attention, kind, tmp_path):
    """Gated attention = the ungated mechanism with its heads' outputs y (the output projection's input) times
    sigmoid(x W_g) before W_O (one gate per head, or per number), x the layer's input; W_g adds d_model x
    (h or h d_v) parameters per layer, which the model's facts count."""
    gated = random_model(tmp_path, f"attention={attention}", f"attention.options.output_gate={kind}", seed=1)
    plain = random_model(tmp_path, f"attention={attention}", seed=1)
    state = {k: v for k, v in gated.state_dict().items() if ".attn.gate." not in k}
    plain.load_state_dict(state)  # the same weights but the gate's
    attn, ref = gated.blocks[0].attn, plain.blocks[0].attn
    width = ref.out.in_features if kind == "elementwise" else gated.cfg.n_head
    assert tuple(attn.gate.weight.shape) == (width, gated.cfg.d_model) and ref.gate is None
    assert parameter_count(gated.cfg) - parameter_count(plain.cfg) == gated.cfg.n_layer * width * gated.cfg.d_model
    heads_out = []
    ref.out.register_forward_pre_hook(lambda module, args: heads_out.append(args[0]))  # y [B, T, h d_v]
    x = torch.randn(2, 12, gated.cfg.d_model)
    pos = torch.arange(12)
    ref(x, pos)
    gate = torch.sigmoid(x @ attn.gate.weight.T)  # [B, T, h] or [B, T, h d_v]
    gate = gate.repeat_interleave(heads_out[0].shape[-1] // gate.shape[-1], dim=-1)  # one per output number
    torch.testing.assert_close(attn(x, pos), ref.out(heads_out[0] * gate), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(attn(x, pos), ref(x, pos), atol=1e-3)  # the gate acts


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_gated_cached_decoding_equals_the_full_forward(attention, tmp_path):
    overrides = (f"attention={attention}", "attention.options.output_gate=elementwise", "size.vocab_size=512")
    assert_cached_decoding_equals_full_forward(random_model(tmp_path, *overrides), length=20, prefill=8)


@pytest.mark.parametrize("attention, kind", [("mha", "elementwise"), ("tpa", "headwise")])
def test_a_gated_model_exports_to_transformers(attention, kind, tmp_path):
    """The export carries the gate: transformers computes the gated T6's logits and greedy tokens."""
    model = random_model(
        tmp_path, f"attention={attention}", f"attention.options.output_gate={kind}", "size.vocab_size=512"
    )
    ckpt = save_training_checkpoint(model, tmp_path / "gated.ckpt", global_step=1)
    hf = load_hf(write_export(ckpt, tmp_path / "t6-gated")[1])
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=0, atol=1e-5)
        got = hf.generate(tokens[:, :6], attention_mask=torch.ones(2, 6), max_new_tokens=8, do_sample=False)
        assert torch.equal(got, model.generate(tokens[:, :6], 8, temperature=0))


@pytest.mark.parametrize("attention", ["mha", "tpa"])
def test_gated_blocks_compile_whole(attention, tmp_path):
    """The gate keeps a block one graph (T6.compile_blocks, what training compiles), forward and backward as eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    overrides = (f"attention={attention}", "attention.options.output_gate=elementwise", "size.vocab_size=512")
    eager, compiled = random_model(tmp_path, *overrides).train(), random_model(tmp_path, *overrides).train()
    counter = CompileCounterWithBackend("aot_eager")
    compiled.compile_blocks(backend=counter)
    idx = torch.randint(0, 512, (2, 16))
    losses = [m(idx[:, :-1], targets=idx[:, 1:]) for m in (eager, compiled)]
    for loss in losses:
        loss.backward()
    assert counter.frame_count == 1
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled.blocks[0].attn.gate.weight.grad, eager.blocks[0].attn.gate.weight.grad)
