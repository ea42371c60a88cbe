"""The Triton decode kernels (the CUDA implementation of t6::tpa_decode / t6::latent_decode)
run on the CPU through Triton's interpreter (TRITON_INTERPRET=1) against the eager reference,
for every shape class they accept: factorized and full queries, fp32/fp16/bf16 caches, batch
1 and > 1, with and without padding masks, rows bounded by lengths in a whole preallocated cache,
lengths that are not multiples of the block or the split, and every tuning of the kernels' table.
This checks the kernels' semantics, not the compiled GPU code."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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

from test_fused_decode import TOL, gqa_inputs, padding_mask, tpa_inputs  # noqa: E402

from t6.model.attention.fused_decode import (  # noqa: E402
    reference_gqa_decode,
    reference_latent_decode,
    reference_tpa_decode,
)

TOL = {**TOL, torch.float16: dict(rtol=1e-2, atol=1e-2)}
# every tuning the kernels' table can select for each kernel, each with one block of tokens per program at least,
# so short test contexts still split across programs
TUNINGS = {
    kernel: [
        dataclasses.replace(t, min_tokens=t.block_s)
        for t in dict.fromkeys(t for key, t in kernels_module.TUNING.items() if key[0] == kernel)
    ]
    for kernel in ("tpa", "latent", "gqa")
}


def tuning_id(t) -> str:
    return f"block{t.block_s}_warps{t.num_warps}_stages{t.num_stages}"


def upcast_bf16_dots(monkeypatch) -> None:
    """Triton's interpreter keeps bf16 values as their uint16 bit patterns and tl.dot multiplies those
    as integers; a tensor core multiplies bf16 operands exactly into its fp32 accumulator, which an fp32
    matmul of the operands converted to fp32 reproduces."""
    import numpy as np
    from triton import language as tl
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def upcast(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        data = (x.data.astype(np.uint32) << 16).view(np.float32)  # bf16 is fp32's upper half
        return interpreter.TensorHandle(data, tl.float32)

    monkeypatch.setattr(
        interpreter.InterpreterBuilder,
        "create_dot",
        lambda self, a, b, *rest: create_dot(self, upcast(a), upcast(b), *rest),
    )


@pytest.fixture(scope="module")
def kernels():
    """The kernels, with TRITON_INTERPRET=1 while they run (triton also reads it at launch)."""
    if not INTERPRETED:
        pytest.skip("triton was imported before the interpreter could be switched on; covered by the subprocess test")
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    upcast_bf16_dots(mp)
    yield kernels_module
    mp.undo()


@pytest.mark.slow  # a fresh process running the kernels under Triton's interpreter (~30 s); its slow tests run here
def test_interpreter_run_in_a_fresh_process_when_triton_was_already_imported():
    if INTERPRETED:
        return  # the tests below run in this process
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", str(Path(__file__))],
        env=env,
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def cases(block: int) -> list[tuple[int, int]]:
    """(batch, cached tokens): one token, part of a block, several blocks and splits with a partial last block."""
    return [(1, 1), (1, block + 13), (3, 3 * block + 6)]


def latent_inputs(B, S, dtype, gen, h=3, d_c=24, d_r=8, max_len=None):
    """Queries and a latent cache [B, max_len, *] viewed up to S; the queries are one latent head's of two
    (GLA's: rows [h, w] contiguous, a stride between the batch's rows)."""
    max_len = max_len or S + 2
    q_lat = (torch.randn(B, 2, h, d_c, generator=gen) * 0.2).to(dtype)[:, 1]  # [B, h, d_c]
    q_rope = (torch.randn(B, 2, h, d_r, generator=gen) * 0.2).to(dtype)[:, 1]  # [B, h, d_rope]
    c_kv = torch.randn(B, max_len, d_c, generator=gen).to(dtype)[:, :S]  # [B, S, d_c]
    k_rope = torch.randn(B, max_len, d_r, generator=gen).to(dtype)[:, :S]  # [B, S, d_rope]
    return q_lat, q_rope, c_kv, k_rope


def as_float(args):
    return [a if a is None else a.float() for a in args]


@pytest.mark.parametrize("tuning", TUNINGS["tpa"], ids=tuning_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("factored", [True, False], ids=["tpa", "full_query"])
def test_triton_tpa_decode_equals_the_eager_reference(kernels, dtype, factored, tuning):
    gen = torch.Generator().manual_seed(0)
    for B, S in cases(tuning.block_s):
        args = tpa_inputs(B, S, factored, dtype, gen, h=5, d=16, R_Q=2, R_K=2, R_V=1)
        for mask in (None, padding_mask(B, S, gen)):
            fast = kernels.tpa_decode(*args, mask, tuning=tuning)
            ref = reference_tpa_decode(*as_float(args), mask)
            assert fast.shape == ref.shape and fast.dtype == dtype
            torch.testing.assert_close(fast.float(), ref, **TOL[dtype], msg=f"B={B} S={S} mask={mask is not None}")


@pytest.mark.parametrize("tuning", TUNINGS["latent"], ids=tuning_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_latent_decode_equals_the_eager_reference(kernels, dtype, tuning):
    gen = torch.Generator().manual_seed(1)
    for B, S in cases(tuning.block_s):
        args = latent_inputs(B, S, dtype, gen)
        for mask in (None, padding_mask(B, S, gen)):
            fast = kernels.latent_decode(*args, mask, tuning=tuning)
            ref = reference_latent_decode(*as_float(args), mask)
            assert fast.shape == ref.shape and fast.dtype == dtype
            torch.testing.assert_close(fast.float(), ref, **TOL[dtype], msg=f"B={B} S={S}")


# GROUPED's forms with fewer heads: the interpreter runs each program in Python
GROUPED_SMALL = {"mha": (3, 3, 16, 16, 0), "gqa": (6, 2, 16, 16, 0), "mqa": (5, 1, 16, 16, 0), "gta": (6, 2, 8, 16, 8)}


# the interpreter runs a tuning's block size; its warps and stages are the compiler's (tests/test_fused_decode.py
# runs each compiled on a GPU, t6.bench.kernel_fit compiles each for sm_90)
@pytest.mark.parametrize("tuning", list({t.block_s: t for t in TUNINGS["gqa"]}.values()), ids=tuning_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", GROUPED_SMALL)
def test_triton_gqa_decode_equals_the_eager_reference(kernels, form, dtype, tuning):
    """MHA, GQA, MQA and GTA's grouped form, one program per (row, K/V head, split)."""
    gen = torch.Generator().manual_seed(20)
    h, h_kv, d_k, d_v, d_rope = GROUPED_SMALL[form]
    for B, S in cases(tuning.block_s)[1:]:
        args = gqa_inputs(B, S, dtype, gen, h=h, h_kv=h_kv, d=d_k, d_v=d_v, d_rope=d_rope)
        for mask in (None, padding_mask(B, S, gen)):
            fast = kernels.gqa_decode(*args, mask, tuning=tuning)
            ref = reference_gqa_decode(*as_float(args), mask)
            assert fast.shape == ref.shape and fast.dtype == dtype
            torch.testing.assert_close(fast.float(), ref, **TOL[dtype], msg=f"B={B} S={S} mask={mask is not None}")


def padding_within(lengths: torch.Tensor, S: int, gen: torch.Generator) -> torch.Tensor:
    """Left padding [B, S] of a different length per row, each row's last valid token visible."""
    starts = (torch.rand(len(lengths), generator=gen) * lengths).long()  # [B], start < length
    return torch.arange(S)[None, :] >= starts[:, None]  # [B, S]


def poison_past(lengths: torch.Tensor, *caches: torch.Tensor) -> None:
    """NaN in every cached position at or past its row's length: a kernel that reads one returns NaN."""
    for cache in caches:
        for b, n in enumerate(lengths.tolist()):
            cache[b, n:] = float("nan")


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("factored", [True, False], ids=["tpa", "full_query"])
def test_lengths_bound_each_row_of_a_whole_cache(kernels, factored, index_dtype):
    """A whole preallocated cache with lengths [B]: each row's result is the row's own first lengths[b]
    tokens alone, and nothing at or past its length is read (NaN there)."""
    gen = torch.Generator().manual_seed(3)
    tuning = TUNINGS["tpa"][0]
    S = 4 * tuning.block_s  # the bucket: the cache's full length
    lengths = torch.tensor([S, 1, tuning.block_s + 5, 3 * tuning.block_s - 1], dtype=index_dtype)
    B = len(lengths)
    q_a, q_b, *cache = tpa_inputs(B, S, factored, torch.float32, gen, h=5, d=16, R_Q=2, R_K=2, R_V=2, max_len=S)
    poison_past(lengths, *cache)
    for mask in (None, padding_within(lengths, S, gen)):
        fast = kernels.tpa_decode(q_a, q_b, *cache, mask, lengths, tuning=tuning)  # [B, h, d_h]
        for b, n in enumerate(lengths.tolist()):
            rows = [None if t is None else t[b : b + 1] for t in (q_a, q_b)]
            alone = reference_tpa_decode(
                *rows, *(t[b : b + 1, :n] for t in cache), None if mask is None else mask[b : b + 1, :n]
            )
            torch.testing.assert_close(fast[b : b + 1], alone, **TOL[torch.float32], msg=f"row {b}, {n} tokens")


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_lengths_bound_each_row_of_a_whole_latent_cache(kernels, index_dtype):
    gen = torch.Generator().manual_seed(4)
    tuning = TUNINGS["latent"][0]
    S = 4 * tuning.block_s
    lengths = torch.tensor([2, S, 2 * tuning.block_s + 1], dtype=index_dtype)
    B = len(lengths)
    q_lat, q_rope, c_kv, k_rope = latent_inputs(B, S, torch.float32, gen, max_len=S)
    poison_past(lengths, c_kv, k_rope)
    for mask in (None, padding_within(lengths, S, gen)):
        fast = kernels.latent_decode(q_lat, q_rope, c_kv, k_rope, mask, lengths, tuning=tuning)  # [B, h, d_c]
        for b, n in enumerate(lengths.tolist()):
            keys = None if mask is None else mask[b : b + 1, :n]
            alone = reference_latent_decode(
                q_lat[b : b + 1], q_rope[b : b + 1], c_kv[b : b + 1, :n], k_rope[b : b + 1, :n], keys
            )
            torch.testing.assert_close(fast[b : b + 1], alone, **TOL[torch.float32], msg=f"row {b}, {n} tokens")


@pytest.mark.parametrize("form", ["mha", "gta"])
def test_lengths_bound_each_row_of_a_whole_grouped_cache(kernels, form):
    gen = torch.Generator().manual_seed(21)
    tuning = TUNINGS["gqa"][0]
    S = 3 * tuning.block_s
    lengths = torch.tensor([S, 1, tuning.block_s + 7])
    B = len(lengths)
    h, h_kv, d_k, d_v, d_rope = GROUPED_SMALL[form]
    q, k, v, q_rope, k_rope = gqa_inputs(B, S, torch.float32, gen, h, h_kv, d_k, d_v, d_rope, max_len=S)
    for b, n in enumerate(lengths.tolist()):  # NaN at and past each row's length, in every cache
        k[b, :, n:], v[b, :, n:] = float("nan"), float("nan")
        if k_rope is not None:
            k_rope[b, n:] = float("nan")
    for mask in (None, padding_within(lengths, S, gen)):
        fast = kernels.gqa_decode(q, k, v, q_rope, k_rope, mask, lengths, tuning=tuning)  # [B, h, d_v]
        for b, n in enumerate(lengths.tolist()):
            rope = (None, None) if q_rope is None else (q_rope[b : b + 1], k_rope[b : b + 1, :n])
            keys = None if mask is None else mask[b : b + 1, :n]
            alone = reference_gqa_decode(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], *rope, keys)
            torch.testing.assert_close(fast[b : b + 1], alone, **TOL[torch.float32], msg=f"row {b}, {n} tokens")


def test_the_table_chooses_by_shape_class_and_dtype_not_by_context():
    """Every table entry is one the tests above run; the choice depends on the model's shapes and the cache's
    dtype alone (fp16 and bf16 alike)."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    picks = {
        kernels_module.tuning_for(k, HP, W, dtype)
        for k in ("tpa", "latent", "gqa")
        for HP in (16, 64)
        for W in (64, 256)
        for dtype in dtypes
    }
    assert picks == set(kernels_module.TUNING.values())
    assert {t.block_s for t in picks} == {t.block_s for tunings in TUNINGS.values() for t in tunings}
    assert all(
        kernels_module.tuning_for("tpa", 64, 64, torch.float16) == kernels_module.tuning_for("tpa", 64, 64, d)
        for d in (torch.bfloat16, torch.float16)
    )


@pytest.mark.slow  # compiles every distinct launch for sm_90 (~50 kernels) in a fresh process (~3 min on 2 cores)
def test_every_launch_of_every_mechanism_fits_an_h100_compiled_ahead_of_time(tmp_path):
    """Each launch the registered mechanisms make at every size, in fp32 and bf16, compiled for sm_90 by Triton's
    own compiler and ptxas (no GPU needed): shared memory within an H100's 232,448 B, no register spilled. The
    table chosen by shape alone failed this: the fp32 TPA kernel at small/medium/large needed 360,448 B."""
    out = tmp_path / "fit.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real compilation, not the interpreter
    done = subprocess.run(
        [sys.executable, "-m", "t6.bench.kernel_fit", "--quiet", "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    import json

    records = json.loads(out.read_text())["records"]
    assert {r["dtype"] for r in records} == {"float32", "bfloat16"}
    used = {u for r in records for u in r["used_by"].split(", ")}
    fused = {"mha", "mqa", "gqa", "gta", "tpa", "tpa_kvonly", "tpa_sigmoid", "tpa_softmax", "mla", "gla"}
    assert used == {f"{name}/{size}" for name in fused for size in ("tiny", "small", "medium", "large", "xl")}
    misfits = [r for r in records if not r["fits"]]
    assert not misfits, misfits
    assert all(r["shared_bytes"] <= kernels_module.SHARED_MEMORY_SM90 and r["spill_bytes"] == 0 for r in records)


class OutOfSharedMemory:
    """A kernel whose launch fails as Triton's does where the compiled kernel needs more shared memory than the
    device has: triton.runtime.errors.OutOfResources, raised at the first launch."""

    def __getitem__(self, grid):
        from triton.runtime.errors import OutOfResources

        def launch(*args, **kwargs):
            raise OutOfResources(360_448, 232_448, "shared memory")

        return launch


@pytest.mark.parametrize("name", ["tpa", "mla"])
def test_a_kernel_out_of_shared_memory_falls_back_to_the_reference_with_the_same_tokens(
    kernels, name, monkeypatch, caplog
):
    """Under Triton's interpreter the fused operators run the Triton kernels on the CPU; where the decode kernel's
    first launch runs out of shared memory, generation warns once and goes on with the eager reference: the
    tokens of a run that never tried the kernels (T6_EAGER=triton_decode)."""
    from test_inference import tiny

    from t6.model import fallback
    from t6.model.t6 import left_pad

    model = tiny(name, block_size=48)
    idx, mask = left_pad([[5, 9, 2], [7, 1, 4, 4, 8, 3, 2]])
    monkeypatch.setenv("T6_EAGER", "triton_decode")
    eager = model.generate(idx, 6, temperature=0, prompt_mask=mask)
    monkeypatch.delenv("T6_EAGER")
    assert fallback.events() == []
    kernel = "_tpa_kernel" if name == "tpa" else "_gqa_kernel"
    monkeypatch.setattr(kernels, kernel, OutOfSharedMemory())
    assert torch.equal(model.generate(idx, 6, temperature=0, prompt_mask=mask), eager)
    (event,) = fallback.events()
    assert event.name == "triton_decode" and event.error.startswith("OutOfResources: out of resource: shared memory")
    assert [r.getMessage() for r in caplog.records if r.name == "t6.model.fallback"] == [event.message()]


def test_splits_fill_the_device_and_keep_a_minimum_share():
    cpu = torch.device("cpu")  # 4 SMs stand in off CUDA
    t = kernels_module.Tuning(block_s=32, num_warps=4, num_stages=2, waves=2, min_tokens=256)
    assert [kernels_module.splits(1, S, t, cpu) for S in (1, 511, 512, 1500)] == [1, 1, 2, 5]  # >= 256 tokens each
    assert [kernels_module.splits(B, 10**6, t, cpu) for B in (1, 3, 16)] == [8, 3, 1]  # waves x SMs over the batch


class Calls(TorchDispatchMode):
    """The aten operators a block of code runs."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kernel", ["tpa", "latent", "gqa"])
def test_a_call_allocates_its_workspace_and_output_and_does_nothing_else_on_the_host(kernel, monkeypatch):
    """Between the operator's entry and its two launches: two allocations (the partials' workspace and the
    result) and the mask's reinterpretation as bytes; no copies, dtype conversions or host reads, which
    cost host time per call and would stop a CUDA graph's capture."""
    launches = []
    for name in ("_tpa_kernel", "_gqa_kernel", "_combine_kernel"):
        monkeypatch.setattr(kernels_module, name, _Launches(name, launches))
    gen = torch.Generator().manual_seed(5)
    mask, lengths = padding_mask(2, 40, gen), torch.tensor([40, 33])
    if kernel == "tpa":
        args = tpa_inputs(2, 40, True, torch.bfloat16, gen)
        call = lambda: kernels_module.tpa_decode(*args, mask, lengths)  # noqa: E731
    elif kernel == "latent":
        args = latent_inputs(2, 40, torch.bfloat16, gen)
        call = lambda: kernels_module.latent_decode(*args, mask, lengths)  # noqa: E731
    else:
        args = gqa_inputs(2, 40, torch.bfloat16, gen, d=8, d_v=16, d_rope=8)  # GTA's, the most arguments
        call = lambda: kernels_module.gqa_decode(*args, mask, lengths)  # noqa: E731
    with Calls() as calls:
        out = call()
    views = {"view", "detach", "unsqueeze"}  # the mask as bytes; the latent as one K/V head
    assert calls.ops.count("new_empty") == 2 and set(calls.ops) <= {"new_empty", *views}, calls.ops
    assert launches == [f"_{'tpa' if kernel == 'tpa' else 'gqa'}_kernel", "_combine_kernel"]
    assert out.dtype == torch.bfloat16


class _Launches:
    """Stands in for a Triton kernel: records `kernel[grid](...)` launches without running them."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append(self.name)


class CompileLog:
    """Wraps a kernel: records, for each launch, what Triton compiles a kernel for (one compiled kernel
    per distinct record): the compile-time constants (tl.constexpr parameters), the launch options
    (num_warps, num_stages) and, for every integer argument not in the kernel's do_not_specialize,
    its value class (== 1, divisible by 16)."""

    def __init__(self, kernel):
        self.kernel, self.seen = kernel, set()
        self.signature = inspect.signature(kernel.fn)
        self.names = [n for n, p in self.signature.parameters.items() if "constexpr" in str(p.annotation)]
        self.free = set(kernel.kwargs.get("do_not_specialize") or ())  # the interpreter keeps jit's options

    def __getitem__(self, grid):
        def launch(*args, num_warps=None, num_stages=None, **kwargs):
            bound = self.signature.bind(*args, **kwargs).arguments
            classes = {
                (n, v == 1, v % 16 == 0)
                for n, v in bound.items()
                if type(v) is int and n not in self.names and n not in self.free
            }
            options = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v}
            self.seen.add((tuple((n, bound[n]) for n in self.names), frozenset(classes), tuple(options.items())))
            return self.kernel[grid](*args, **kwargs, **options)

        return launch


def test_one_compiled_kernel_serves_every_context_length(kernels, monkeypatch):
    """Decoding token after token must not compile a new kernel as the context (hence the number of
    splits) grows, nor as the rows' lengths change: what Triton specializes a launch on is the same at
    every length."""
    gen = torch.Generator().manual_seed(2)
    tuning = TUNINGS["tpa"][0]  # one launch configuration for every kernel here
    names = ("_tpa_kernel", "_gqa_kernel", "_combine_kernel")
    logs = {name: CompileLog(getattr(kernels, name)) for name in names}
    for name, log in logs.items():
        monkeypatch.setattr(kernels, name, log)
    block = tuning.block_s
    contexts = (1, block + 1, 2 * block, 2 * block + 8, 6 * block + 4)
    for S in contexts:
        args = tpa_inputs(1, S, True, torch.float32, gen, h=5, d=16, R_Q=2, R_K=2, R_V=1)
        kernels.tpa_decode(*args, None, tuning=tuning)
        q_lat, q_rope, c_kv, k_rope = latent_inputs(1, S, torch.float32, gen, max_len=8 * block)
        mask = torch.ones(1, S, dtype=torch.bool)  # a view of a preallocated cache; the mask's row stride is S
        kernels.latent_decode(q_lat, q_rope, c_kv, k_rope, mask, tuning=tuning)
        whole = latent_inputs(1, 8 * block, torch.float32, gen)  # a whole cache bounded by the row's length
        kernels.latent_decode(*whole, None, torch.tensor([S]), tuning=tuning)
        grouped = gqa_inputs(1, S, torch.float32, gen, h=30, h_kv=2, max_len=8 * block)  # views of one cache
        kernels.gqa_decode(*grouped, mask, tuning=tuning)
        whole = gqa_inputs(1, 8 * block, torch.float32, gen, h=30, h_kv=2)  # a whole grouped cache, bounded
        kernels.gqa_decode(*whole, None, torch.tensor([S]), tuning=tuning)
    assert {kernels.splits(1, S, tuning, torch.device("cpu")) for S in contexts} == {1, 2, 6}
    assert {kernels.splits(2, S, tuning, torch.device("cpu")) for S in contexts} == {1, 2, 4}  # rows: K/V heads
    assert len(logs["_tpa_kernel"].seen) == 1, logs["_tpa_kernel"].seen
    # the latent form and the grouped heads, each with a mask and with lengths
    assert len(logs["_gqa_kernel"].seen) == 4, logs["_gqa_kernel"].seen
    # the partials' widths: 16 (TPA's and the grouped heads': one compiled combine) and 32 (the latent's)
    assert len(logs["_combine_kernel"].seen) == 2, logs["_combine_kernel"].seen
