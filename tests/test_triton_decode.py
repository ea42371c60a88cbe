"""The Triton decode kernels (the CUDA implementation of t6::tpa_decode / t6::latent_decode)
run on the CPU through Triton's interpreter (TRITON_INTERPRET=1) against the eager reference,
for every shape class they accept: factorized and full queries, fp32/fp16/bf16 caches, batch
1 and > 1, with and without padding masks, lengths that are not multiples of the block or the
split. This checks the kernels' semantics, not the compiled GPU code."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# triton.jit reads TRITON_INTERPRET when a function is defined (triton's own library included),
# so the interpreter is switched on for the first import of triton, here at collection; the
# variable is restored afterwards. If triton was imported earlier in this process, the tests
# re-run this file in a fresh interpreter instead.
_fresh = "triton" not in sys.modules
_before = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    triton = pytest.importorskip("triton")
    from t6.model.attention import triton_decode as kernels_module
finally:
    if _before is None:
        os.environ.pop("TRITON_INTERPRET")
    else:
        os.environ["TRITON_INTERPRET"] = _before
INTERPRETED = _fresh or _before == "1"

from test_fused_decode import TOL, padding_mask, tpa_inputs  # noqa: E402

from t6.model.attention.fused_decode import reference_latent_decode, reference_tpa_decode  # noqa: E402

TOL = {**TOL, torch.float16: dict(rtol=1e-2, atol=1e-2)}


@pytest.fixture(scope="module")
def kernels():
    """The kernels, with TRITON_INTERPRET=1 while they run (triton also reads it at launch)."""
    if not INTERPRETED:
        pytest.skip("triton was imported before the interpreter could be switched on; covered by the subprocess test")
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    yield kernels_module
    mp.undo()


def test_interpreter_run_in_a_fresh_process_when_triton_was_already_imported():
    if INTERPRETED:
        return  # the tests below run in this process
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__))],
        env=env,
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


CASES = [(1, 1), (1, 45), (3, 70)]  # (batch, cached tokens): one token, part of a block, several splits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("factored", [True, False], ids=["tpa", "full_query"])
def test_triton_tpa_decode_equals_the_eager_reference(kernels, dtype, factored):
    gen = torch.Generator().manual_seed(0)
    for B, S in CASES:
        args = tpa_inputs(B, S, factored, dtype, gen, h=5, d=16, R_Q=2, R_K=2, R_V=1)
        for mask in (None, padding_mask(B, S, gen)):
            fast = kernels.tpa_decode(*args, mask, block_s=16)
            ref = reference_tpa_decode(*(a if a is None else a.float() for a in args), mask)
            assert fast.shape == ref.shape and fast.dtype == dtype
            torch.testing.assert_close(fast.float(), ref, **TOL[dtype], msg=f"B={B} S={S} mask={mask is not None}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_latent_decode_equals_the_eager_reference(kernels, dtype):
    gen = torch.Generator().manual_seed(1)
    for B, S in CASES:
        q_lat = (torch.randn(B, 3, 24, generator=gen) * 0.2).to(dtype)
        q_rope = (torch.randn(B, 3, 8, generator=gen) * 0.2).to(dtype)
        c_kv = torch.randn(B, S + 2, 24, generator=gen).to(dtype)[:, :S]
        k_rope = torch.randn(B, S + 2, 8, generator=gen).to(dtype)[:, :S]
        for mask in (None, padding_mask(B, S, gen)):
            fast = kernels.latent_decode(q_lat, q_rope, c_kv, k_rope, mask, block_s=16)
            ref = reference_latent_decode(q_lat.float(), q_rope.float(), c_kv.float(), k_rope.float(), mask)
            torch.testing.assert_close(fast.float(), ref, **TOL[dtype], msg=f"B={B} S={S}")


class CompileLog:
    """Wraps a kernel: records, for each launch, what Triton compiles a kernel for (one compiled kernel
    per distinct record): the compile-time constants (tl.constexpr parameters) and, for every integer
    argument not in the kernel's do_not_specialize, its value class (== 1, divisible by 16)."""

    def __init__(self, kernel):
        self.kernel, self.seen = kernel, set()
        self.signature = inspect.signature(kernel.fn)
        self.names = [n for n, p in self.signature.parameters.items() if "constexpr" in str(p.annotation)]
        self.free = set(kernel.kwargs.get("do_not_specialize") or ())  # the interpreter keeps jit's options

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            bound = self.signature.bind(*args, **kwargs).arguments
            classes = {
                (n, v == 1, v % 16 == 0)
                for n, v in bound.items()
                if type(v) is int and n not in self.names and n not in self.free
            }
            self.seen.add((tuple((n, bound[n]) for n in self.names), frozenset(classes)))
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_one_compiled_kernel_serves_every_context_length(kernels, monkeypatch):
    """Decoding token after token must not compile a new kernel as the context (hence the number of
    splits) grows: what Triton specializes a launch on is the same at every length."""
    gen = torch.Generator().manual_seed(2)
    tpa, latent = CompileLog(kernels._tpa_kernel), CompileLog(kernels._latent_kernel)
    monkeypatch.setattr(kernels, "_tpa_kernel", tpa)
    monkeypatch.setattr(kernels, "_latent_kernel", latent)
    lengths = (1, 17, 32, 40, 100)  # 1, 2, 2, 3 and 7 splits in 16-token blocks (off CUDA: up to 8 programs)
    for S in lengths:
        kernels.tpa_decode(*tpa_inputs(1, S, True, torch.float32, gen, h=5, d=16, R_Q=2, R_K=2, R_V=1), None, 16)
        c_kv, k_rope = torch.randn(1, 128, 24, generator=gen)[:, :S], torch.randn(1, 128, 8, generator=gen)[:, :S]
        mask = torch.ones(1, S, dtype=torch.bool)  # a view of a preallocated cache; the mask's row stride is S
        kernels.latent_decode(
            torch.randn(1, 3, 24, generator=gen), torch.randn(1, 3, 8, generator=gen), c_kv, k_rope, mask, 16
        )
    assert {kernels._partials(1, S, 8, 16, 16, torch.device("cpu"))[1] for S in lengths} == {1, 2, 3, 7}
    assert len(tpa.seen) == 1 and len(latent.seen) == 1, (tpa.seen, latent.seen)
