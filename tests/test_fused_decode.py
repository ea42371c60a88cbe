"""The fused decode operators (t6::tpa_decode, t6::latent_decode) against their eager references:
fp32 and bf16, batch > 1, padding masks, context lengths around the kernel's block size, and the
model's cached decoding through them against recomputation for every mechanism."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_inference import NAMES, tiny

from t6.model.attention import fused_decode, get_attention_class
from t6.model.attention.fused_decode import (
    gqa_decode,
    latent_decode,
    reference_gqa_decode,
    reference_latent_decode,
    reference_tpa_decode,
    tpa_decode,
)
from t6.model.t6 import left_pad

LENGTHS = [2, 31, 32, 33, 100, 257]  # around the C++ kernel's 32-token blocks and its thread split
# head counts that pad to 1, 4 and 6 vectors of 8 floats (AVX2; 1, 2 and 3 of 16 with AVX-512), which
# take the operators' different register tiles (value tiles of 6 heads and of 2; score tiles of 2 rows x
# 6 vectors, 3 x 4, 4 x 3 and 4 x 1)
HEADS = (7, 30, 45)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def padding_mask(B: int, S: int, gen: torch.Generator) -> torch.Tensor:
    """Left padding of a different length per row (row 0 none); the last position is always visible."""
    starts = torch.randint(0, S, (B,), generator=gen)
    starts[0] = 0
    return torch.arange(S)[None, :] >= starts[:, None]  # [B, S]


def tpa_inputs(B, S, factored, dtype, gen, h=7, d=16, R_Q=3, R_K=2, R_V=3, max_len=None):
    """A factor cache [B, max_len, R, n] viewed up to S (as KVCache.update returns it) and a query."""
    max_len = max_len or S + 5

    def cache(R, n):
        return torch.randn(B, max_len, R, n, generator=gen).to(dtype)[:, :S]  # [B, S, R, n] (a view)

    q_a = (torch.randn(B, R_Q, h, generator=gen) * 0.3).to(dtype) if factored else None
    q_b = torch.randn(B, R_Q if factored else h, d, generator=gen).to(dtype) * 0.3
    return q_a, q_b, cache(R_K, h), cache(R_K, d), cache(R_V, h), cache(R_V, d)


def gqa_inputs(B, S, dtype, gen, h=6, h_kv=2, d=16, d_v=None, d_rope=0, max_len=None):
    """A query and a head-major K/V cache [B, h_kv, max_len, d] viewed up to S (as KVCache.update returns it); with
    d_rope, the shared RoPE part of every key (GTA's: k_rope [B, max_len, d_rope] viewed up to S) and its query."""
    max_len = max_len or S + 5
    q = (torch.randn(B, h, d, generator=gen) * 0.3).to(dtype)  # [B, h, d]
    k = torch.randn(B, h_kv, max_len, d, generator=gen).to(dtype)[:, :, :S]  # [B, h_kv, S, d] (a view)
    v = torch.randn(B, h_kv, max_len, d_v or d, generator=gen).to(dtype)[:, :, :S]  # [B, h_kv, S, d_v]
    if not d_rope:
        return q, k, v, None, None
    q_rope = (torch.randn(B, h, d_rope, generator=gen) * 0.3).to(dtype)  # [B, h, d_rope]
    k_rope = torch.randn(B, max_len, d_rope, generator=gen).to(dtype)[:, :S]  # [B, S, d_rope]
    return q, k, v, q_rope, k_rope


# (h, h_kv, d_k, d_v, d_rope): MHA (a dot per token and head), GQA and MQA (each K/V head's rows against its whole
# group at once; 15 and 31 query heads pad to whole vectors), GTA (keys half as wide as the values, which are
# not a whole vector wide, plus the shared RoPE part)
GROUPED = {"mha": (7, 7, 16, 16, 0), "gqa": (30, 2, 16, 16, 0), "mqa": (31, 1, 16, 16, 0), "gta": (6, 2, 8, 16, 8)}


def requires_extension():
    if fused_decode.cpu_extension() is None:
        pytest.fail("the fused CPU decode kernels did not build (g++, Python headers and ninja are required)")


def test_a_build_killed_midway_does_not_make_later_loads_wait_forever():
    """torch's build lock is a file: a build killed while holding it (a timeout, Ctrl-C twice) leaves it
    behind, and torch's own loader then waits for it without end. The kernels still load."""
    requires_extension()
    stale = fused_decode.build_directory() / "lock"
    stale.touch()
    try:
        code = "from t6.model.attention.fused_decode import cpu_extension; assert cpu_extension() is not None"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=240)
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


def test_each_cpu_gets_its_own_build(monkeypatch):
    """The kernels are compiled with -march=native: a torch extensions cache shared by machines with
    other vector units (a home directory on a cluster) must not hand an AVX-512 build to an AVX2 CPU."""
    here = fused_decode.build_directory()
    assert "flags" in fused_decode.cpu_features() or "Features" in fused_decode.cpu_features()  # read, not empty
    monkeypatch.setattr(fused_decode, "cpu_features", lambda: "model name: another CPU|flags: sse sse2")
    assert fused_decode.build_directory() != here
    assert fused_decode.build_directory().parent == here.parent


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("factored", [True, False], ids=["tpa", "full_query"])
def test_tpa_decode_equals_the_eager_reference(dtype, factored):
    requires_extension()
    gen = torch.Generator().manual_seed(0)
    for h in HEADS:
        for B in (1, 3):
            for S in LENGTHS:
                args = tpa_inputs(B, S, factored, dtype, gen, h=h)
                for mask in (None, padding_mask(B, S, gen)):
                    fast = tpa_decode(*args, mask)  # [B, h, d_h]
                    ref = reference_tpa_decode(*(a if a is None else a.float() for a in args), mask)
                    assert fast.shape == (B, h, 16) and fast.dtype == dtype
                    msg = f"h={h} B={B} S={S} mask={mask is not None}"
                    torch.testing.assert_close(fast.float(), ref, **TOL[dtype], msg=msg)


def test_tpa_decode_masks_padding_exactly():
    """A padded row gives what the same row gives with its padding removed from the cache."""
    requires_extension()
    gen = torch.Generator().manual_seed(1)
    q_a, q_b, a_k, b_k, a_v, b_v = tpa_inputs(1, 90, True, torch.float32, gen)
    mask = torch.arange(90)[None] >= 37  # [1, S]: 37 padding tokens on the left
    padded = tpa_decode(q_a, q_b, a_k, b_k, a_v, b_v, mask)
    alone = tpa_decode(q_a, q_b, *(t[:, 37:].contiguous() for t in (a_k, b_k, a_v, b_v)), None)
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_decode_equals_the_eager_reference(dtype):
    requires_extension()
    gen = torch.Generator().manual_seed(2)
    d_r = 8
    # d_c a whole number of vectors (fp32 rows read in place) and not (rows converted); GLA's latent head:
    # one of several per token, a strided view
    for h, d_c, heads in ((5, 48, 1), (5, 42, 2), (23, 48, 1), (45, 42, 2)):
        for B in (1, 3):
            for S in LENGTHS:
                q_lat = (torch.randn(B, h, d_c, generator=gen) * 0.2).to(dtype)
                q_rope = (torch.randn(B, h, d_r, generator=gen) * 0.2).to(dtype)
                c_kv = torch.randn(B, S + 3, heads, d_c, generator=gen).to(dtype)[:, :S, -1]  # [B, S, d_c] view
                k_rope = torch.randn(B, S + 3, d_r, generator=gen).to(dtype)[:, :S]  # [B, S, d_rope]
                for mask in (None, padding_mask(B, S, gen)):
                    fast = latent_decode(q_lat, q_rope, c_kv, k_rope, mask)  # [B, h, d_c]
                    ref = reference_latent_decode(q_lat.float(), q_rope.float(), c_kv.float(), k_rope.float(), mask)
                    torch.testing.assert_close(fast.float(), ref, **TOL[dtype], msg=f"h={h} d_c={d_c} B={B} S={S}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", GROUPED)
def test_gqa_decode_equals_the_eager_reference(dtype, form):
    requires_extension()
    gen = torch.Generator().manual_seed(11)
    h, h_kv, d_k, d_v, d_rope = GROUPED[form]
    for B in (1, 3):
        for S in LENGTHS:
            args = gqa_inputs(B, S, dtype, gen, h=h, h_kv=h_kv, d=d_k, d_v=d_v, d_rope=d_rope)
            for mask in (None, padding_mask(B, S, gen)):
                fast = gqa_decode(*args, mask)  # [B, h, d_v]
                ref = reference_gqa_decode(*(a if a is None else a.float() for a in args), mask)
                assert fast.shape == (B, h, d_v) and fast.dtype == dtype
                torch.testing.assert_close(fast.float(), ref, **TOL[dtype], msg=f"B={B} S={S} mask={mask is not None}")


def test_gqa_decode_is_softmax_attention_with_each_kv_head_repeated_for_its_group():
    """The reference itself against SDPA with K and V repeated per query head (the definition of grouped heads),
    the shared RoPE part as more key columns and query columns."""
    gen = torch.Generator().manual_seed(12)
    q, k, v, q_rope, k_rope = gqa_inputs(2, 40, torch.float32, gen, h=6, h_kv=2, d=8, d_v=16, d_rope=8)
    mask = padding_mask(2, 40, gen)
    keys = torch.cat([k, k_rope[:, None].expand(-1, 2, -1, -1)], dim=-1).repeat_interleave(3, 1)  # [B, h, S, 16]
    queries = torch.cat([q, q_rope], dim=-1)[:, :, None]  # [B, h, 1, 16]
    expected = torch.nn.functional.scaled_dot_product_attention(
        queries, keys, v.repeat_interleave(3, 1), attn_mask=mask[:, None, None], scale=1.0
    )[:, :, 0]  # [B, h, d_v]
    torch.testing.assert_close(reference_gqa_decode(q, k, v, q_rope, k_rope, mask), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("form", ["mha", "gqa", "gta"])
def test_gqa_lengths_bound_each_row_of_a_whole_cache(form, index_dtype):
    """As for the other operators: a whole cache bounded by lengths [B] gives each row its own first lengths[b]
    tokens alone, what lies past them never seen."""
    requires_extension()
    gen = torch.Generator().manual_seed(13)
    S, lens = 100, [100, 1, 33, 64]
    lengths = torch.tensor(lens, dtype=index_dtype)
    h, h_kv, d_k, d_v, d_rope = GROUPED[form]
    q, k, v, q_rope, k_rope = gqa_inputs(len(lens), S, torch.float32, gen, h, h_kv, d_k, d_v, d_rope, max_len=S)
    for b, n in enumerate(lens):
        k[b, :, n:], v[b, :, n:] = 1e4, 1e4  # would dominate every score and value if it were seen
        if k_rope is not None:
            k_rope[b, n:] = 1e4
    for mask in (None, rows_within(lens, S, gen)):
        for label, fn in (("operator", gqa_decode), ("reference", reference_gqa_decode)):
            out = fn(q, k, v, q_rope, k_rope, mask, lengths)  # [B, h, d_v]
            for b, n in enumerate(lens):
                alone = reference_gqa_decode(
                    q[b : b + 1],
                    k[b : b + 1, :, :n],
                    v[b : b + 1, :, :n],
                    None if q_rope is None else q_rope[b : b + 1],
                    None if k_rope is None else k_rope[b : b + 1, :n],
                    None if mask is None else mask[b : b + 1, :n],
                )
                torch.testing.assert_close(out[b : b + 1], alone, **TOL[torch.float32], msg=f"{label} row {b}")


def test_gqa_decode_refuses_shapes_that_do_not_group_by_name():
    q, k, v, q_rope, k_rope = gqa_inputs(1, 8, torch.float32, torch.Generator().manual_seed(14), d_rope=4)
    with pytest.raises(ValueError, match="5 query heads are not a multiple of 2 K/V heads"):
        gqa_decode(q[:, :-1].contiguous(), k, v, None, None, None)
    with pytest.raises(ValueError, match="q_rope and k_rope come together"):
        gqa_decode(q, k, v, q_rope, None, None)


def test_operators_are_registered_with_schema_and_fake_implementations():
    gen = torch.Generator().manual_seed(3)
    args = tpa_inputs(2, 40, True, torch.float32, gen)
    mask = padding_mask(2, 40, gen)
    lengths = torch.tensor([40, 29])
    checks = ("test_schema", "test_faketensor")
    for extra in ((mask,), (mask, lengths), (None, lengths)):
        torch.library.opcheck(torch.ops.t6.tpa_decode.default, (*args, *extra), test_utils=checks)
        latent = (torch.randn(2, 3, 16), torch.randn(2, 3, 4), torch.randn(2, 40, 16), torch.randn(2, 40, 4), *extra)
        torch.library.opcheck(torch.ops.t6.latent_decode.default, latent, test_utils=checks)
        grouped = gqa_inputs(2, 40, torch.float32, gen, d_rope=4)
        torch.library.opcheck(torch.ops.t6.gqa_decode.default, (*grouped, *extra), test_utils=checks)
    with torch.device("meta"):  # the fake implementation gives the output's shape without computing
        meta = tpa_decode(*(None if a is None else a.to("meta") for a in args), None, lengths.to("meta"))
    assert meta.shape == (2, 7, 16)


def rows_within(lengths: list[int], S: int, gen: torch.Generator) -> torch.Tensor:
    """Left padding [B, S] of a different length per row, each row's last valid token visible."""
    starts = torch.tensor([int(torch.randint(0, n, (1,), generator=gen)) for n in lengths])  # [B]
    return torch.arange(S)[None, :] >= starts[:, None]  # [B, S]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lengths_bound_each_row_of_a_whole_cache(dtype, index_dtype):
    """A whole preallocated cache [B, S, ...] with lengths [B]: each row's result is that of its own first
    lengths[b] tokens alone (what lies past a row's length is finite garbage, as a reused cache holds),
    through the C++ kernels and the eager reference."""
    requires_extension()
    gen = torch.Generator().manual_seed(6)
    S, lens = 100, [100, 1, 33, 64]
    lengths = torch.tensor(lens, dtype=index_dtype)
    B = len(lens)
    tpa_args = tpa_inputs(B, S, True, dtype, gen, max_len=S)
    q_lat, q_rope = (torch.randn(B, 5, 48, generator=gen) * 0.2).to(dtype), (torch.randn(B, 5, 8) * 0.2).to(dtype)
    c_kv, k_rope = torch.randn(B, S, 48, generator=gen).to(dtype), torch.randn(B, S, 8, generator=gen).to(dtype)
    for cache in (*tpa_args[2:], c_kv, k_rope):
        for b, n in enumerate(lens):
            cache[b, n:] = 1e4  # would dominate every score and value if it were seen
    for mask in (None, rows_within(lens, S, gen)):
        for op, reference in ((tpa_decode, reference_tpa_decode), (latent_decode, reference_latent_decode)):
            args = tpa_args if op is tpa_decode else (q_lat, q_rope, c_kv, k_rope)
            n_cache = 4 if op is tpa_decode else 2
            queries, caches = args[: len(args) - n_cache], args[len(args) - n_cache :]
            for label, fn in (("operator", op), ("reference", reference)):
                out = fn(*args, mask, lengths)  # [B, h, d]
                for b, n in enumerate(lens):
                    alone = reference(
                        *(None if q is None else q[b : b + 1].float() for q in queries),
                        *(c[b : b + 1, :n].float() for c in caches),
                        None if mask is None else mask[b : b + 1, :n],
                    )
                    msg = f"{label} {reference.__name__} row {b}, {n} tokens"
                    torch.testing.assert_close(out[b : b + 1].float(), alone, **TOL[dtype], msg=msg)


def test_lengths_of_the_wrong_shape_or_dtype_are_refused_by_name():
    args = tpa_inputs(2, 10, True, torch.float32, torch.Generator().manual_seed(7))
    for bad in (torch.tensor([10]), torch.tensor([10.0, 9.0]), torch.tensor([[10, 9]])):
        with pytest.raises(ValueError, match="lengths must be an int32 or int64 tensor"):
            tpa_decode(*args, None, bad)


FUSED = [n for n in NAMES if hasattr(get_attention_class(n), "fused_decode")]  # mechanisms with a fused decode path


@pytest.mark.parametrize("name", FUSED)
def test_fused_layer_decoding_equals_the_eager_path(name):
    """The attention layer's single-token cached step, fused and eager, on a padded batch."""
    model = tiny(name)
    attn = model.blocks[0].attn
    x = torch.randn(3, 40, model.cfg.d_model)
    cache = attn.build_kv_cache(3, 48)
    cache.key_mask = torch.cat(
        [padding_mask(3, 39, torch.Generator().manual_seed(4)), torch.ones(3, 9, dtype=torch.bool)], 1
    )
    attn(x[:, :39], torch.arange(39), cache)
    pos = torch.tensor([39])
    attn.fused_decode = True
    fused = attn(x[:, 39:], pos, cache)
    attn.fused_decode = False
    eager = attn(x[:, 39:], pos, cache)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", [n for n in NAMES if get_attention_class(n).supports_key_mask])
def test_bf16_cached_decoding_of_a_padded_batch_follows_recomputation(name):
    """bf16 weights and caches, prompts of different lengths: every cached step's logits are
    those of recomputing the row alone without a cache (within bf16 rounding). Mechanisms without
    padding masks refuse such batches (tests/test_inference.py)."""
    model = tiny(name).to(torch.bfloat16)
    prompts = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 2], [11]]
    idx, mask = left_pad(prompts)
    out = model.generate(idx, 5, temperature=0, prompt_mask=mask)
    T0 = idx.shape[1]
    caches = model.build_kv_caches(3, T0 + 5)
    for cache in caches:
        cache.key_mask = torch.cat([mask, torch.ones(3, 5, dtype=torch.bool)], dim=1)
    logits = [model(idx, 0, caches)[:, -1]]  # [3, V]
    for t in range(4):
        logits.append(model(out[:, T0 + t : T0 + t + 1], T0 + t, caches)[:, -1])
    for i, p in enumerate(prompts):
        seq = torch.cat([torch.tensor(p), out[i, T0:]])[None]  # the row's own tokens, no padding
        full = model(seq)[0, len(p) - 1 : len(p) + 4]  # [5, V]: recomputed logits at each step
        torch.testing.assert_close(torch.stack([l[i] for l in logits]).float(), full.float(), rtol=0.05, atol=0.05)


def test_mla_training_attention_with_padded_values_is_unchanged():
    """MLA pads V (d_v) to the query/key width for flash SDPA kernels; the output equals
    attention computed without padding."""
    model = tiny("mla")
    attn = model.blocks[0].attn
    assert attn.d_v < attn.d_nope + attn.d_rope  # the padded case
    B, T, h = 2, 9, model.cfg.n_head
    q_nope, q_rope = torch.randn(B, T, h, attn.d_nope), torch.randn(B, T, h, attn.d_rope)
    c_kv, k_rope = torch.randn(B, T, attn.d_c), torch.randn(B, T, attn.d_rope)
    y = attn._explicit(q_nope, q_rope, c_kv, k_rope)  # [B, T, h, d_v]
    kv = attn.kv_up(c_kv).view(B, T, h, -1)
    k_nope, v = kv.split([attn.d_nope, attn.d_v], dim=-1)
    q = torch.cat([q_nope, q_rope], -1).transpose(1, 2)  # [B, h, T, nope+rope]
    k = torch.cat([k_nope, k_rope[:, :, None].expand(B, T, h, -1)], -1).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2) * attn.scale).masked_fill(
        ~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")
    )
    ref = (scores.softmax(-1) @ v.transpose(1, 2)).transpose(1, 2)  # [B, T, h, d_v]
    assert y.shape == (B, T, h, attn.d_v)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def compiled_kernels():
    """The Triton kernels compiled for CUDA, or a skip: without a CUDA device, or where this process
    defined them under Triton's interpreter (tests/test_triton_decode.py imports them with
    TRITON_INTERPRET=1; test_compiled_kernels_run_in_a_fresh_process runs these tests without it)."""
    if not torch.cuda.is_available():
        pytest.skip("the compiled Triton kernels need a CUDA device")
    from t6.model.attention import triton_decode

    if type(triton_decode._tpa_kernel).__name__ == "InterpretedFunction":
        pytest.skip("the kernels were defined under Triton's interpreter here; covered by the fresh-process test")
    return triton_decode


@pytest.mark.cuda
def test_compiled_kernels_run_in_a_fresh_process():
    if not torch.cuda.is_available():
        pytest.skip("the compiled Triton kernels need a CUDA device")
    from t6.model.attention import triton_decode

    if type(triton_decode._tpa_kernel).__name__ != "InterpretedFunction":
        return  # the tests below run in this process
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda", __file__],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def medium_tpa(B, S, factored, gen, lengths=None):
    """TPA's medium shapes (h=47, d_h=64, ranks 6/2/2) in bf16 on CUDA, a whole cache when lengths are given."""
    args = tpa_inputs(B, S, factored, torch.bfloat16, gen, h=47, d=64, R_Q=6, R_K=2, R_V=2, max_len=S)
    return [None if a is None else a.cuda() for a in args]


def medium_latent(B, S, gen, h=23, d_c=256, d_r=32):
    """MLA's medium shapes (h=23, d_c=256, d_rope=32) in bf16 on CUDA."""
    q_lat = (torch.randn(B, h, d_c, generator=gen) * 0.05).to(torch.bfloat16)
    q_rope = (torch.randn(B, h, d_r, generator=gen) * 0.05).to(torch.bfloat16)
    c_kv, k_rope = torch.randn(B, S, d_c, generator=gen), torch.randn(B, S, d_r, generator=gen)
    return [t.cuda() for t in (q_lat, q_rope, c_kv.to(torch.bfloat16), k_rope.to(torch.bfloat16))]


# (h, h_kv, d_k, d_v, d_rope) at medium: MHA, GQA (15 query heads per K/V head), MQA (31), GTA
MEDIUM_GROUPED = {
    "mha": (16, 16, 64, 64, 0),
    "gqa": (30, 2, 64, 64, 0),
    "mqa": (31, 1, 64, 64, 0),
    "gta": (30, 2, 32, 64, 32),
}


def medium_grouped(form: str, B: int, S: int, gen: torch.Generator) -> list:
    """A grouped form's medium shapes in bf16 on CUDA: query, whole head-major K/V caches, the RoPE part or None."""
    h, h_kv, d_k, d_v, d_rope = MEDIUM_GROUPED[form]
    args = gqa_inputs(B, S, torch.bfloat16, gen, h=h, h_kv=h_kv, d=d_k, d_v=d_v, d_rope=d_rope, max_len=S)
    return [None if a is None else a.cuda() for a in args]


def cuda_lengths(B: int, S: int, gen: torch.Generator) -> torch.Tensor:
    lengths = torch.randint(1, S + 1, (B,), generator=gen)
    lengths[0] = S
    return lengths.cuda()


@pytest.mark.cuda
def test_cuda_kernels_equal_the_eager_reference():
    """Every tuning of the table, compiled for this GPU, on the medium shapes with padding and lengths."""
    kernels = compiled_kernels()
    gen = torch.Generator().manual_seed(8)
    for tuning in dict.fromkeys(kernels.TUNING.values()):
        for B, S in ((1, 3000), (4, 777)):
            lengths = cuda_lengths(B, S, gen)
            mask = rows_within(lengths.tolist(), S, gen).cuda()
            for factored in (True, False):
                args = medium_tpa(B, S, factored, gen)
                fast = kernels.tpa_decode(*args, mask, lengths, tuning=tuning)
                ref = reference_tpa_decode(*(a if a is None else a.float() for a in args), mask, lengths)
                torch.testing.assert_close(fast.float(), ref, **TOL[torch.bfloat16], msg=f"{tuning} B={B} S={S}")
            args = medium_latent(B, S, gen)
            fast = kernels.latent_decode(*args, mask, lengths, tuning=tuning)
            ref = reference_latent_decode(*(a.float() for a in args), mask, lengths)
            torch.testing.assert_close(fast.float(), ref, **TOL[torch.bfloat16], msg=f"{tuning} B={B} S={S}")
            for form in MEDIUM_GROUPED:
                args = medium_grouped(form, B, S, gen)
                fast = kernels.gqa_decode(*args, mask, lengths, tuning=tuning)
                ref = reference_gqa_decode(*(a if a is None else a.float() for a in args), mask, lengths)
                torch.testing.assert_close(fast.float(), ref, **TOL[torch.bfloat16], msg=f"{form} {tuning} B={B} S={S}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_operators_run_their_tables_tuning_at_medium_in_fp32_and_bf16(dtype):
    """The operators as a model calls them, each with the table's tuning for its shapes and dtype, launch on this
    GPU (the fp32 TPA kernel once needed 360,448 B of shared memory: out of resources on an H100) and equal the
    reference; nothing fell back."""
    compiled_kernels()
    from t6.model import fallback

    gen = torch.Generator().manual_seed(10)
    B, S = 2, 4096
    lengths = cuda_lengths(B, S, gen)
    tpa_args = [None if a is None else a.to(dtype) for a in medium_tpa(B, S, True, gen)]
    latent_args = [a.to(dtype) for a in medium_latent(B, S, gen)]
    grouped = [[None if a is None else a.to(dtype) for a in medium_grouped(f, B, S, gen)] for f in MEDIUM_GROUPED]
    for op, ref, args in (
        (tpa_decode, reference_tpa_decode, tpa_args),
        (latent_decode, reference_latent_decode, latent_args),
        *((gqa_decode, reference_gqa_decode, args) for args in grouped),
    ):
        fast = op(*args, None, lengths)
        expected = ref(*(a if a is None else a.float() for a in args), None, lengths)
        torch.testing.assert_close(fast.float(), expected, rtol=2e-2, atol=2e-2)  # fp32 dots run as TF32
    assert fallback.events() == []


@pytest.mark.cuda
def test_cuda_decode_replays_in_a_cuda_graph_with_new_lengths_and_cache():
    """The operators captured once in a CUDA graph over a whole cache: replays after the rows' lengths and
    the cache changed in place give what eager calls give."""
    compiled_kernels()
    gen = torch.Generator().manual_seed(9)
    B, S = 3, 2048
    tpa_args, latent_args, mha_args = (
        medium_tpa(B, S, True, gen),
        medium_latent(B, S, gen),
        medium_grouped("mha", B, S, gen),
    )
    lengths = cuda_lengths(B, S, gen)

    def step():
        return (
            tpa_decode(*tpa_args, None, lengths),
            latent_decode(*latent_args, None, lengths),
            gqa_decode(*mha_args, None, lengths),
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(3):
        lengths.copy_(cuda_lengths(B, S, gen))
        for t in (*tpa_args[2:], *latent_args[2:], *mha_args[1:3]):
            t.normal_()
        graph.replay()
        for graphed, eager in zip(outs, step()):
            torch.testing.assert_close(graphed, eager, rtol=0, atol=0)
