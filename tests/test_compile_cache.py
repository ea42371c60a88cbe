"""torch.compile's caches in the project's folder (t6.hardware.compile_cache): a second identical compile loads
what the first compiled, from that folder."""

from __future__ import annotations

import os

import torch

from t6.hardware.compile_cache import ENV, TRITON_ENV, cache_counts, cache_state, compile_cache


def test_a_second_identical_compile_loads_from_the_project_cache(tmp_path):
    """A matmul forward and backward: inductor's graphs are library calls only (no C++ to build), so a cold compile
    takes seconds. After dynamo forgets the first compile, the second is a lookup: AOTAutograd's cache hits."""
    before = os.environ.get(ENV), os.environ.get(TRITON_ENV)
    cache = tmp_path / "compile"
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    assert not cache_state(cache).warm
    with compile_cache(cache):
        assert os.environ[ENV] == str(cache) and os.environ[TRITON_ENV] == str(cache / "triton")
        counts = []
        for _ in range(2):
            torch._dynamo.reset()  # a new process would remember nothing either
            start = cache_counts()
            f = torch.compile(lambda x: x @ w, fullgraph=True, dynamic=False)
            f(x).backward(torch.ones(4, 8))  # [4, 8]: the forward and backward graphs
            counts.append({k: v - start[k] for k, v in cache_counts().items()})
    assert (os.environ.get(ENV), os.environ.get(TRITON_ENV)) == before  # the process's settings as they were
    assert counts[0]["aot_misses"] == 1 and counts[0]["aot_hits"] == 0  # compiled, and stored in `cache`
    assert counts[1]["aot_hits"] == 1 and counts[1]["aot_misses"] == 0  # loaded
    assert cache_state(cache).warm and (cache / "aotautograd").is_dir()
    torch.testing.assert_close(w.grad, 2 * x.T @ torch.ones(4, 8))  # both backwards ran: twice x^T 1
