"""The memory a generation needs: the weights, the KV caches at full length, and the largest transient of its
prefill, which is the peak (a decode step's transients are one token's).

    generation_memory(cfg, batch=16, prompt=32768, new_tokens=128, dtype=torch.bfloat16)

The prefill is traced at its real size on fake tensors (FakeTensorMode: shapes and dtypes, no data), the whole
model, while `PeakMemory` follows every tensor it creates and frees: the caches, each block's intermediates, the
logits. What keeps 32k tokens x batch 16 within a GPU: no [T, S] tensor anywhere (SDPA's flash kernel, MLA and
GLA's prefill through it too) and the LM head at the last position only (T6.prefill; all positions' logits
were 52.8 GB in bf16 there). tests/test_inference.py holds every mechanism at medium to an 80 GB GPU.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from t6.model import T6, ModelConfig
from t6.model.facts import kv_bytes_per_token, parameter_count


class PeakMemory(TorchDispatchMode):
    """The peak bytes of the tensors created inside it and still alive (storages counted once however many views
    share them; tensors from before it, such as weights and caches, not counted)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage -> [bytes, tensors alive on it]
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        before = {id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t) not in before:  # an in-place op returns its input
                self.track(t)
        return out

    def track(self, t: torch.Tensor) -> None:
        key = t.untyped_storage()._cdata
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [t.untyped_storage().nbytes(), 0]
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        weakref.finalize(t, self.release, key)

    def release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.now -= entry[0]
                del self.live[key]


def prefill_peak_bytes(cfg: ModelConfig, batch: int, prompt: int, cache_len: int, dtype: torch.dtype) -> int:
    """The peak bytes of the caches (cache_len positions) and every tensor a prefill of batch x prompt tokens
    creates, the weights left out, traced on fake tensors (nothing is computed or allocated: the real size costs
    seconds) through the CPU's kernels, which are the GPU's in kind (SDPA's flash kernel: no [T, S] scores)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = dataclasses.replace(cfg, block_size=max(cfg.block_size, cache_len))
    default = torch.get_default_dtype()
    with FakeTensorMode():
        torch.set_default_dtype(dtype)  # fake parameters are built in their dtype (they cannot be converted)
        try:
            model = T6(cfg).eval()
        finally:
            torch.set_default_dtype(default)
        idx = torch.zeros(batch, prompt, dtype=torch.long)  # [B, T]
        with torch.no_grad(), PeakMemory() as memory:
            caches = model.build_kv_caches(batch, cache_len, dtype)
            model.prefill(idx, caches)  # [B, vocab]
    return memory.peak


def generation_memory(cfg: ModelConfig, batch: int, prompt: int, new_tokens: int, dtype: torch.dtype) -> dict:
    """Bytes a generation of new_tokens after a prompt needs at its peak, the prefill: the weights, the caches at
    full length and the prefill's transients (`prefill_peak_bytes`)."""
    weights = parameter_count(cfg) * dtype.itemsize
    caches = batch * (prompt + new_tokens) * kv_bytes_per_token(cfg, dtype)
    traced = prefill_peak_bytes(cfg, batch, prompt, prompt + new_tokens, dtype)
    return {
        "weights_bytes": weights,
        "cache_bytes": caches,
        "prefill_transient_bytes": traced - caches,
        "peak_bytes": weights + traced,
    }
