"""t6::tpa_contract, TPA's contraction as a custom operator (t6.model.attention.factor_contract): its Triton
kernels under Triton's interpreter (TRITON_INTERPRET=1) against the eager reference, forward and backward; the
operator's registration (schema, fake, autograd) and its fallback; TPA's training path through it; and the
kernels compiled ahead of time for sm_90 (H100, H200) within its shared memory and without spilled registers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from t6.model import ModelConfig, fallback
from t6.model.attention.factor_contract import reference_contract, reference_contract_backward, triton_or_reference

# (R, h, d_h): medium TPA's query (R_Q = 6, 47 heads) and keys/values (R = 2), and sizes padded on both axes
SHAPES = [(6, 47, 64), (2, 47, 64), (3, 7, 12)]


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # set before this process imported triton


@pytest.fixture(scope="module")
def kernels():
    """The kernels' module, defined under Triton's interpreter: triton.jit reads TRITON_INTERPRET when a function is
    defined (the mechanisms' discovery imports the module), so these tests run in a process started with it
    (`test_the_kernels_run_in_the_interpreter_in_a_fresh_process`)."""
    if not INTERPRETED:
        pytest.skip("triton runs compiled in this process; the fresh process with TRITON_INTERPRET=1 runs this test")
    pytest.importorskip("triton")
    from t6.model.attention import triton_contract

    return triton_contract


@pytest.mark.slow  # a fresh process running the kernels under Triton's interpreter (~20 s)
def test_the_kernels_run_in_the_interpreter_in_a_fresh_process():
    if INTERPRETED:
        return  # the tests below run in this process
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    args = ["-k", "kernels_equal or falls_back", "-q", "-p", "no:cacheprovider", __file__]
    done = subprocess.run([sys.executable, "-m", "pytest", *args], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "7 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


def factors(R: int, h: int, d: int, dtype: torch.dtype):
    """A and B as TPA's training path has them: views into one stacked projection's output, token stride wider
    than a row ([B, T, R, h] and [B, T, R, d_h], non-contiguous)."""
    g = torch.Generator().manual_seed(R * 1000 + h)
    out = torch.randn(2, 5, R * (h + d) + 3, generator=g).to(dtype)  # [B, T, width]
    a = out[..., : R * h].unflatten(-1, (R, h))  # [B, T, R, h]
    b = out[..., R * h : R * (h + d)].unflatten(-1, (R, d))  # [B, T, R, d_h]
    grad = torch.randn(2, 5, h, d, generator=g).to(dtype)  # [B, T, h, d_h]
    return a, b, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R, h, d", SHAPES)
def test_kernels_equal_the_reference_forward_and_backward(kernels, R, h, d, dtype):
    a, b, grad = factors(R, h, d, dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    out = kernels.forward(a, b)  # [B, T, h, d_h]
    assert out.shape == (2, 5, h, d) and out.dtype == dtype
    torch.testing.assert_close(out.float(), reference_contract(a.float(), b.float()), **tol)
    da, db = kernels.backward(grad, a, b)  # [B, T, R, h], [B, T, R, d_h]
    ref_da, ref_db = reference_contract_backward(grad.float(), a.float(), b.float())
    assert da.dtype == db.dtype == dtype
    torch.testing.assert_close(da.float(), ref_da, **tol)
    torch.testing.assert_close(db.float(), ref_db, **tol)
    # a gradient that is a transposed view (SDPA's backward hands [B, h, T, d_h] back)
    g_t = grad.transpose(1, 2).contiguous().transpose(1, 2)  # [B, T, h, d_h], token stride 1 x d_h
    torch.testing.assert_close(kernels.backward(g_t, a, b)[0].float(), ref_da, **tol)


def test_the_operator_is_registered_with_its_fake_and_autograd_and_its_gradients_are_the_references():
    a, b, grad = factors(2, 5, 8, torch.float64)
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    torch.library.opcheck(torch.ops.t6.tpa_contract.default, (a, b))  # schema, fake, autograd registration
    torch.library.opcheck(torch.ops.t6.tpa_contract_backward.default, (grad, a.detach(), b.detach()))
    out = torch.ops.t6.tpa_contract(a, b)  # [B, T, h, d_h]
    da, db = torch.autograd.grad(out, [a, b], grad)
    ref = torch.einsum("btrh,btrd->bthd", a, b) / 2  # (1/R) A^T B, R = 2
    ref_da, ref_db = torch.autograd.grad(ref, [a, b], grad)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(da, ref_da, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(db, ref_db, rtol=1e-12, atol=1e-12)


def test_a_kernel_that_fails_falls_back_to_the_reference_for_the_rest_of_the_process(kernels, monkeypatch):
    a, b, grad = factors(2, 5, 8, torch.float32)
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("out of resources: shared memory, required: 300000, hardware limit: 232448")

    monkeypatch.setattr(kernels, "forward", broken)
    out = triton_or_reference("forward", a, b)
    torch.testing.assert_close(out, reference_contract(a, b))
    assert [e.name for e in fallback.events()] == ["triton_contract"] and not fallback.enabled("triton_contract")
    triton_or_reference("forward", a, b)
    da, _ = triton_or_reference("backward", grad, a, b)  # not tried either: the reference
    assert calls == [1]
    torch.testing.assert_close(da, reference_contract_backward(grad, a, b)[0])


@pytest.mark.parametrize("name", ["tpa", "tpa_kvonly"])
def test_the_training_path_through_the_operator_equals_the_per_map_formulation(name, monkeypatch):
    """With triton_contract on, TPA's layer contracts Q, K, V through t6::tpa_contract (on the CPU its reference:
    the kernels are the CUDA implementation); output and every gradient as the paper writes the layer, and under
    torch.compile the operator is one node of the graph each way."""
    from test_tpa_training import AtenOps, assert_equals_per_map, layer

    from t6.model.attention.tpa import TensorProductAttention

    monkeypatch.setattr(TensorProductAttention, "triton_contract", True)
    attn = layer(name)
    assert_equals_per_map(attn)
    x = torch.randn(2, 12, 48, dtype=torch.float64, requires_grad=True)
    ops = AtenOps()
    torch._dynamo.reset()  # no shapes remembered from earlier compiles of this code
    torch.compile(attn, backend=ops, fullgraph=True, dynamic=False)(x, torch.arange(12)).sum().backward()
    contracted = 2 if name == "tpa_kvonly" else 3  # K, V (and the factorized Q)
    assert ops.forward.count(torch.ops.t6.tpa_contract.default) == contracted
    assert ops.backward.count(torch.ops.t6.tpa_contract_backward.default) == contracted


AOT = """
import torch
from t6.bench.kernel_fit import compile_for_sm90
from t6.model.attention import triton_contract as k
for dtype in (torch.float32, torch.bfloat16):
    for R in (6, 2):
        h, d, N = 47, 64, 16
        a, b = torch.empty(N, R, h, dtype=dtype), torch.empty(N, R, d, dtype=dtype)
        g, out = torch.empty(N, h, d, dtype=dtype), torch.empty(N, h, d, dtype=dtype)
        consts = dict(R=R, **k.blocks(h, d))
        args = (a, b, out, R * h, h, R * d, d, h, d, 1.0 / R)
        fwd = compile_for_sm90(k.contract_forward, args, consts, k.NUM_WARPS, 1)
        args = (g, a, b, a, b, h * d, d, R * h, h, R * d, d, h, d, 1.0 / R)
        bwd = compile_for_sm90(k.contract_backward, args, consts, k.NUM_WARPS, 1)
        for name, fit in (("forward", fwd), ("backward", bwd)):
            print(name, dtype, R, fit["shared_bytes"], fit["registers"], fit["spill_bytes"])
            assert fit["shared_bytes"] <= 232448 and fit["spill_bytes"] == 0, fit
"""


@pytest.mark.slow  # triton's compiler and ptxas for sm_90, in a process without the interpreter (~20 s)
def test_the_kernels_compile_for_sm90_within_its_shared_memory_and_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", AOT], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("\n") == 8  # forward and backward, fp32 and bf16, R = 6 and 2


def test_layer_shape_of_the_training_configs():
    """The shapes the kernels above are checked at are medium TPA's (47 heads of 64, R_Q = 6, R_K = R_V = 2)."""
    from t6.bench.common import model_configs

    cfg: ModelConfig = model_configs(["tpa"], "medium")["tpa"]
    opts = cfg.options()
    assert (cfg.n_head, cfg.head_dim, opts.q_rank, opts.k_rank, opts.v_rank) == (47, 64, 6, 2, 2)
