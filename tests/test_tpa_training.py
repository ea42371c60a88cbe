"""TPA's training path (t6.model.attention.tpa): every factor from one stacked projection, RoPE on B_Q and
B_K in one pass, and the contraction written for torch.compile, against the per-map formulation the
cached path keeps (A^T B by einsum, each factor map on its own)."""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.testing import CompileCounterWithBackend
from torch._functorch.aot_autograd import aot_module_simplified

from t6.model import ModelConfig
from t6.model.attention import available, get_attention_class
from t6.model.attention.tpa import TensorProductAttention, contract

TPA_FAMILY = [n for n in available() if issubclass(get_attention_class(n), TensorProductAttention)]


def layer(name: str, dtype=torch.float64) -> TensorProductAttention:
    cfg = ModelConfig(attention=name, n_layer=1, d_model=48, n_head=5, head_dim=8, block_size=32, vocab_size=64)
    torch.manual_seed(0)
    attn = get_attention_class(name)(cfg).to(dtype)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.2)  # the zero-initialized W_O too
    return attn


def per_map_forward(attn: TensorProductAttention, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The layer as the paper writes it: each factor map on its own, RoPE on B_Q and B_K, then
    Q, K, V = (1/R) A^T B by einsum, causal SDPA and W_O."""
    B, T, _ = x.shape
    q = attn.query(x, pos)  # [B, T, h, d_h]
    a_k, b_k = attn.k(x)  # [B, T, R_K, h], [B, T, R_K, d_h]
    a_v, b_v = attn.v(x)  # [B, T, R_V, h], [B, T, R_V, d_h]
    k = torch.einsum("btrh,btrd->bthd", a_k, attn.rope(b_k, pos)) / a_k.shape[2]  # [B, T, h, d_h]
    v = torch.einsum("btrh,btrd->bthd", a_v, b_v) / a_v.shape[2]  # [B, T, h, d_h]
    y = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    )  # [B, h, T, d_h]
    return attn.out(y.transpose(1, 2).reshape(B, T, -1))  # [B, T, d_model]


@pytest.mark.parametrize("name", TPA_FAMILY)
def test_training_path_equals_the_per_map_formulation(name):
    assert_equals_per_map(layer(name))


def assert_equals_per_map(attn: TensorProductAttention) -> None:
    """The layer's training path (no cache), output and every gradient, against `per_map_forward`, in fp64."""
    x = torch.randn(2, 12, 48, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(3, 15)  # not from 0: RoPE at the positions given
    fused = attn(x, pos)  # [B, T, d_model]
    grads = torch.autograd.grad(fused.square().sum(), [x, *attn.parameters()])
    reference = per_map_forward(attn, x, pos)
    ref_grads = torch.autograd.grad(reference.square().sum(), [x, *attn.parameters()])
    torch.testing.assert_close(fused, reference, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_compiled_contraction_equals_einsum_forward_and_backward():
    a = torch.randn(2, 5, 6, 7, dtype=torch.float64, requires_grad=True)  # [B, T, R, h]
    b = torch.randn(2, 5, 6, 8, dtype=torch.float64, requires_grad=True)  # [B, T, R, d_h]
    traced = CompileCounterWithBackend("eager")
    compiled = torch.compile(contract, backend=traced, fullgraph=True)(a, b)  # the outer-product form
    grads = torch.autograd.grad(compiled.square().sum(), [a, b])
    eager = contract(a, b)  # einsum
    ref_grads = torch.autograd.grad(eager.square().sum(), [a, b])
    assert traced.frame_count == 1
    assert not any(node.target is torch.einsum for g in traced.graphs for node in g.graph.nodes)
    torch.testing.assert_close(compiled, eager, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


class AtenOps:
    """A torch.compile backend that records the ATen ops of the forward and backward graphs (AOT autograd)
    and runs them as they are."""

    def __init__(self):
        self.forward: list = []
        self.backward: list = []

    def __call__(self, gm, example_inputs):
        def record(into):
            def compiler(graph, _):
                into.extend(n.target for n in graph.graph.nodes if n.op == "call_function")
                return make_boxed_func(graph.forward)

            return compiler

        return aot_module_simplified(
            gm, example_inputs, fw_compiler=record(self.forward), bw_compiler=record(self.backward)
        )


@pytest.mark.parametrize("name", ["tpa", "tpa_kvonly"])
def test_compiled_training_path_is_one_graph_with_one_projection_and_no_batched_matmul(name):
    """Under torch.compile the whole layer is one graph; its forward runs two matmuls (the stacked factor
    maps and W_O; the per-map form runs seven or five) and no batched matmul: the contraction is the
    elementwise outer-product form that inductor fuses with RoPE."""
    attn = layer(name, torch.float32)
    x = torch.randn(2, 12, 48, requires_grad=True)
    ops = AtenOps()
    torch._dynamo.reset()  # no shapes remembered from earlier compiles of this code (they would make T dynamic)
    out = torch.compile(attn, backend=ops, fullgraph=True, dynamic=False)(x, torch.arange(12))  # [B, T, d_model]
    out.sum().backward()
    aten = torch.ops.aten
    assert ops.forward.count(aten.mm.default) == 2
    assert aten.bmm.default not in ops.forward + ops.backward
    assert ops.backward.count(aten.mm.default) == 4  # the input and weight gradients of the two matmuls


def test_inductor_scheduled_for_a_gpu_leaves_two_matmuls_and_attention_and_no_batched_matmul():
    """t6.bench.fusion: inductor's own fusion for Triton (GPU code generation stops after it): TPA's forward leaves
    the stacked projection, W_O and attention as library calls, its contraction and RoPE in generated kernels; the
    backward the four matmul gradients and attention's."""
    from t6.bench.fusion import layer_fusion

    cfg = ModelConfig(attention="tpa", n_layer=1, d_model=48, n_head=5, head_dim=8, block_size=32, vocab_size=64)
    record = layer_fusion(cfg, 2, 16, torch.float32)
    forward, backward = record["forward_library_calls"], record["backward_library_calls"]
    assert forward == "1 _scaled_dot_product_flash_attention_for_cpu, 2 mm"
    assert backward == "1 _scaled_dot_product_flash_attention_for_cpu_backward, 4 mm"
    assert record["forward_kernels"] >= 1 and record["backward_kernels"] >= 1
    assert record["forward_kernel_bytes_per_token"] >= 3 * 5 * 8 * 4  # Q, K, V [h, d_h] in fp32 written once at least
