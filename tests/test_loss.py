"""The chunked LM head + cross-entropy equals the plain one, in value and in both gradients; so does
Liger-Kernel's fused kernel (the CUDA default), run on the CPU through Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from t6.model.loss import IGNORE_INDEX, liger_chunk_rows, linear_cross_entropy, use_liger

from conftest import random_model


def plain(h, w, y):
    return F.cross_entropy((h @ w.t()).flatten(0, -2), y.flatten(), ignore_index=IGNORE_INDEX)


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])  # one token, uneven chunks, exact split, one chunk
def test_loss_and_gradients_equal_the_plain_path(chunk):
    torch.manual_seed(0)
    h0, w0 = torch.randn(2, 32, 16, dtype=torch.float64), torch.randn(97, 16, dtype=torch.float64)
    y = torch.randint(0, 97, (2, 32))
    y[0, :5] = IGNORE_INDEX  # ignored targets count neither in the sum nor in the mean
    h, w = leaves(h0, w0)
    ref = plain(h, w, y)
    ref.backward()
    hc, wc = leaves(h0, w0)
    out = linear_cross_entropy(hc, wc, y, chunk_tokens=chunk)
    (out * 3.0).backward()  # the incoming gradient scales both results
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hc.grad, 3.0 * h.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(wc.grad, 3.0 * w.grad, rtol=1e-10, atol=1e-12)


def test_without_gradients_it_is_the_same_loss_and_builds_none():
    torch.manual_seed(1)
    h, w, y = torch.randn(50, 8), torch.randn(33, 8, requires_grad=True), torch.randint(0, 33, (50,))
    with torch.no_grad():
        out = linear_cross_entropy(h, w, y, chunk_tokens=16)
    assert out.grad_fn is None
    torch.testing.assert_close(out, plain(h, w.detach(), y), rtol=1e-6, atol=1e-6)


def test_bad_chunk_size_is_an_error():
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        linear_cross_entropy(torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long), chunk_tokens=0)


def test_model_loss_equals_cross_entropy_of_its_logits_with_tied_gradients(tmp_path):
    """Through the whole T6: the embedding is the head (tied), so its gradient gets both uses."""
    model = random_model(tmp_path).double().train()
    x, y = torch.randint(0, model.cfg.vocab_size, (2, 2, 16)).unbind(0)
    ref = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    ref.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    out = model(x, targets=y, loss_chunk_tokens=5)
    out.backward()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-9, atol=1e-12, msg=name)


def test_bf16_autocast_matches_the_plain_head_under_autocast():
    torch.manual_seed(2)
    h0, w0, y = torch.randn(40, 32), torch.randn(64, 32), torch.randint(0, 64, (40,))
    h, w = leaves(h0, w0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(h, w).float(), y)
    ref.backward()
    hc, wc = leaves(h0, w0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_cross_entropy(hc, wc, y, chunk_tokens=16)
    out.backward()
    assert hc.grad.dtype == wc.grad.dtype == torch.float32  # fp32 leaves get fp32 gradients
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(hc.grad, h.grad, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(wc.grad, w.grad, rtol=2e-2, atol=2e-3)


def test_loss_impl_chooses_liger_on_cuda_only_and_names_a_bad_setting(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert use_liger("auto", "cuda") and use_liger("liger", "cuda")
    assert not use_liger("auto", "cpu") and not use_liger("chunked", "cuda")
    with pytest.raises(ValueError, match="loss_impl=liger needs a CUDA device"):
        use_liger("liger", "cpu")
    with pytest.raises(ValueError, match="must be one of auto, chunked, liger"):
        linear_cross_entropy(torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long), impl="fused")


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Triton's interpreter from the start, on a machine without CUDA (Liger puts buffers on a CUDA device it finds, which
# the interpreter cannot read): the subprocess test below runs these so on any machine.
IN_INTERPRETER = pytest.mark.skipif(
    not INTERPRETED or torch.cuda.is_available(), reason="needs Triton's interpreter and no CUDA: the subprocess test"
)


@IN_INTERPRETER
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_liger_loss_and_gradients_equal_the_chunked_path(autocast):
    """Liger's kernel against the chunked path: fp32 to float rounding; under bf16 autocast both
    run the matmuls in bf16, so they agree to bf16's rounding of the logits."""
    torch.manual_seed(0)
    h0, w0 = torch.randn(3, 40, 32), torch.randn(300, 32) * 0.3
    y = torch.randint(0, 300, (3, 40))
    y[1, :7] = IGNORE_INDEX
    results = []
    for impl in ("chunked", "liger"):
        h, w = leaves(h0, w0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = linear_cross_entropy(h, w, y, chunk_tokens=16, impl=impl)
        (out * 3.0).backward()
        results.append((out, h.grad, w.grad))
    tol = dict(rtol=2e-2, atol=2e-3) if autocast else dict(rtol=1e-5, atol=1e-6)
    for ref, got, name in zip(results[0], results[1], ("loss", "dh", "dW")):
        assert got.dtype == ref.dtype, name
        torch.testing.assert_close(got, ref, **tol, msg=name)


@IN_INTERPRETER
def test_liger_holds_the_rows_of_logits_the_memory_estimate_counts():
    """t6.training.step_memory counts liger_chunk_rows(N, V, d) rows of logits for Liger's loss: the rows of every
    [rows, V] product Liger forms (recorded at the dispatcher)."""

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.rows = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out) and out.shape[-1] == V:
                self.rows.add(out.shape[0])
            return out

    V, d = 300, 32
    for N in (120, 7, 1000):
        h, w = leaves(torch.randn(N, d), torch.randn(V, d) * 0.3)
        with Products() as seen:
            linear_cross_entropy(h, w, torch.randint(0, V, (N,)), impl="liger").backward()
        full = liger_chunk_rows(N, V, d)
        assert max(seen.rows) == full and seen.rows <= {full, N % full}, (N, seen.rows)


@pytest.mark.slow  # a fresh process running Liger's kernel under Triton's interpreter (~9 s)
def test_liger_runs_in_the_triton_interpreter():
    """The test above in a fresh process with TRITON_INTERPRET=1 (triton reads it when its kernels are
    defined, at import, and this process has imported triton already)."""
    if INTERPRETED:
        return  # the test above runs in this process
    done = (
        subprocess.run(  # on the CPU: Liger puts buffers on a CUDA device it finds, which the interpreter cannot read
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-k",
                "test_liger_loss_and_gradients_equal_the_chunked_path or test_liger_holds_the_rows",
                str(__file__),
            ],
            env={**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""},
            capture_output=True,
            text=True,
            cwd=Path(__file__).parents[1],
        )
    )
    assert done.returncode == 0 and "3 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
