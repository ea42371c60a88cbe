"""Fixed-shape decoding (t6.model.static_decode), the CPU-checkable half of the CUDA-graph decoder: for every
registered mechanism the static step's blocks compile whole (fullgraph), one graph for all of them, once per
cache-length bucket and never per token; the step reads nothing back to the host, passes the capture lint, and
generates the tokens of the eager path.

Most compiled steps here skip inductor's code generation (tens of seconds of C++ compilation per graph on
a small CPU): the "eager" backend runs the graph dynamo captures, which is what fullgraph and recompilation
are about; "aot_eager" also runs it through AOTAutograd's functionalization (the in-place cache writes
included), which is the graph inductor receives. The slow tests at the end run inductor itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_inference import NAMES, ScalarReads, tiny
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import t6.model.t6
from t6.model import ModelConfig, fallback
from t6.model.attention import KVCache
from t6.model.attention.base import flex_decode
from t6.model.static_decode import MIN_BUCKET, CudaGraphs, StaticDecoder, bucket
from t6.model.t6 import T6, left_pad

PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 2], [11]]  # left-padded to 7 tokens


def test_bucket_is_the_next_power_of_two_within_the_cache():
    assert [bucket(n, 4096) for n in (1, MIN_BUCKET, MIN_BUCKET + 1, 1000, 1025, 4096)] == [
        MIN_BUCKET,
        MIN_BUCKET,
        2 * MIN_BUCKET,
        1024,
        2048,
        4096,
    ]
    assert bucket(3000, 3000) == 3000 and bucket(5, 100) == 100  # never past the cache
    for bad in (0, 4097):
        with pytest.raises(ValueError, match=f"over {bad} cached tokens does not fit a cache of 4096"):
            bucket(bad, 4096)


def test_a_static_cache_returns_fixed_length_views_and_masks_what_is_not_yet_written():
    cache = KVCache({"k": (2, 3)}, batch_size=2, max_len=16, head_major=("k",))
    cache.key_mask = torch.tensor([[False] * 2 + [True] * 14, [True] * 16])  # [B, 16]: row 0 left-padded
    cache.static_len = 8
    pos = torch.tensor([5])
    (k,) = cache.update(pos, k=torch.ones(2, 1, 2, 3))
    assert k.shape == (2, 2, 8, 3) and k[:, :, 5].eq(1).all() and k.sum() == 2 * 2 * 3  # written at 5 only
    expected = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)  # [B, 8]
    assert torch.equal(cache.attn_mask(pos), expected[:, None])
    assert cache.lengths(pos).tolist() == [6, 6]  # the fused operators read no further
    for static_len, pos in ((8, torch.tensor([5])), (None, torch.tensor([3, 4, 5]))):  # mask_mod is attn_mask
        cache.static_len = static_len
        mask = cache.attn_mask(pos).expand(2, len(pos), -1)  # [B, T, S]
        b, q, s = torch.meshgrid(*(torch.arange(n) for n in mask.shape), indexing="ij")
        assert torch.equal(cache.mask_mod(pos)(b, 0, q, s), mask)
    assert cache.lengths(pos) is None  # dynamic shapes: the views end at the newest token


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("group", [1, 3, 4])  # 3: padded to FlexAttention's power-of-two groups
def test_flex_decode_is_masked_softmax_attention_for_any_group_size(group):
    B, h_kv, L, d = 2, 2, 300, 16
    cache = KVCache({"k": (h_kv, d)}, batch_size=B, max_len=L, head_major=("k",))
    cache.key_mask = torch.arange(L)[None, :] >= torch.tensor([[0], [37]])  # [B, L]: row 1 left-padded
    cache.static_len = L
    pos = torch.tensor([200])
    q, k, v = torch.randn(B, h_kv * group, 1, d), torch.randn(B, h_kv, L, d), torch.randn(B, h_kv, L, d)
    y = flex_decode(q, k, v, cache.mask_mod(pos), pos[-1])  # [B, h, 1, d]
    mask = cache.attn_mask(pos)[:, None]  # [B, 1, 1, L]: keys 0..200, padding hidden
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask
    )  # [B, h, 1, d]
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def padded_batch():
    idx, mask = left_pad(PROMPTS)
    return idx, mask


@pytest.mark.parametrize("name", NAMES)
def test_the_static_step_compiles_once_for_every_block_and_64_positions_and_generates_todays_tokens(name):
    model = tiny(name, block_size=128)  # every step in one bucket (min(128, MIN_BUCKET)); two blocks
    idx, mask = padded_batch()
    counter = CompileCounterWithBackend("eager")
    decoder = StaticDecoder(model, 3, compile=True, backend=counter)
    out = model.generate(idx, 65, temperature=0, prompt_mask=mask, decode=decoder)  # 64 steps: positions 7..70
    assert torch.equal(out, model.generate(idx, 65, temperature=0, prompt_mask=mask, decode="eager"))
    again = torch.tensor([[3, 1, 4, 1, 5, 9, 2]] * 3)  # a new generation, unpadded, in the same decoder
    assert torch.equal(model.generate(again, 5, temperature=0, decode=decoder), model.generate(again, 5, temperature=0))
    assert counter.frame_count == 1  # one graph: compiled at the first block of the first step, run by every later


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("name", NAMES)
def test_a_static_step_never_reads_a_tensor_back_to_the_host(name, monkeypatch):
    # eager flex_attention runs its operator through torch.compile, which refuses a dispatch mode; this runs it as is
    monkeypatch.setattr(torch.nn.attention.flex_attention, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    model = tiny(name, block_size=128)
    idx, mask = padded_batch()
    decoder = StaticDecoder(model, 3, backend="eager")
    decoder.prefill(idx, mask)
    for cache in decoder.caches:
        cache.static_len = 128
    with ScalarReads() as reads, torch.no_grad():
        model.decode_step(torch.randint(0, 256, (3, 1)), torch.tensor([7]), decoder.caches)  # as compiled, run eagerly
    assert reads.count == 0


aten = torch.ops.aten
# what makes the host wait for the device (a value read back, an output whose size depends on values)
HOST_SYNCS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten.masked_select.default,
    aten.repeat_interleave.Tensor,
    aten._unique2.default,
}
RANDOM = {"rand", "randn", "randint", "randperm", "normal", "uniform", "bernoulli", "multinomial", "exponential"}
RANDOM |= {"random", "native_dropout", "rand_like", "randn_like", "randint_like", "geometric", "cauchy", "log_normal"}


class CaptureLint(TorchDispatchMode):
    """Records each operation of a block of code that a CUDA graph's capture forbids or gets wrong, with the step's
    tensors on `device` (the meta device stands in for the GPU on a machine without one): a host sync (a value
    read back, an output sized by values, a boolean index), a random number (its generator's offset is the
    capture's), and a tensor on any other device, read or made (a CPU tensor copied in is read once at capture
    and replayed stale, or synchronizes)."""

    supports_higher_order_operators = True

    def __init__(self, device: str):
        super().__init__()
        self.device, self.problems = torch.device(device), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_SYNCS:
            self.problems.append(f"{func}: a host sync")
        name = func.overloadpacket.__name__ if isinstance(func, torch._ops.OpOverload) else ""
        if name.rstrip("_") in RANDOM:
            self.problems.append(f"{func}: a random number")
        if func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.problems.append(f"{func}: a boolean index (nonzero, a host sync)")
        self.check_devices(func, "reads", (args, kwargs))
        out = func(*args, **kwargs)
        self.check_devices(func, "makes", out)
        return out

    def check_devices(self, func, role: str, tensors) -> None:
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor) and t.device != self.device:
                self.problems.append(f"{func} {role} a {t.device} tensor {tuple(t.shape)}")


def test_the_capture_lint_sees_what_a_capture_forbids():
    x = torch.ones(4, 3)
    with CaptureLint("cpu") as lint:
        x.sum().item()
        x.nonzero()
        x[x[:, 0] > 0]
        torch.randn(3)
        torch.rand_like(x)
        x * 2  # allowed
    found = [p.split(": ", 1)[1] for p in lint.problems]
    assert found == ["a host sync"] * 2 + ["a boolean index (nonzero, a host sync)"] + ["a random number"] * 2
    y, scale = torch.ones(3, device="meta"), torch.tensor(2.0)  # a CPU scalar: a capture would bake in its value
    with CaptureLint("meta") as lint:
        y * scale  # a CPU tensor read
        torch.arange(4)  # a CPU tensor made
    assert lint.problems == ["aten.mul.Tensor reads a cpu tensor ()", "aten.arange.default makes a cpu tensor (4,)"]


@pytest.mark.parametrize("name", NAMES)
def test_every_fixed_shape_step_is_safe_to_capture(name):
    """The fixed-shape decode step (what a CUDA graph records) of every mechanism, with its tensors on the meta
    device: no host sync, no random number, no tensor of another device read or made, with a left-padded batch.
    (Triton's compiles happen at the warm-up call before the capture: tests/test_triton_decode.py shows a kernel
    compiled once serves every length.)"""
    cfg = ModelConfig(attention=name, n_layer=2, d_model=64, n_head=4, vocab_size=256, block_size=128)
    with torch.device("meta"):
        model = T6(cfg).eval()
    decoder = StaticDecoder(model, 3, dtype=torch.float32)
    idx, mask = (t.to("meta") for t in padded_batch())
    with torch.no_grad():
        decoder.prefill(idx, mask)
        for cache in decoder.caches:
            cache.static_len = bucket(idx.shape[1] + 1, decoder.max_len)
        with CaptureLint("meta") as lint:
            decoder.advance(decoder.tokens, decoder.pos, decoder.caches)  # FixedStep's run: what a capture records
    assert lint.problems == []


class MatmulCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (aten.mm.default, aten.addmm.default, aten.bmm.default)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["gqa", "gta", "mla", "tpa"])
def test_a_fixed_shape_step_stacks_projections_and_reads_the_weights_of_each_generation(name):
    """Each layer's projections of one input run as one matmul in the fixed-shape step (Q, K, V; W_gate and W_up;
    MLA's two down maps; TPA's six factor maps); weights trained between generations are the ones the next
    generation reads, and a projection a hook wraps runs as its module (the hook acts), with the eager path's tokens
    every time."""
    model = tiny(name, block_size=64)
    idx, mask = padded_batch()
    decoder = StaticDecoder(model, 3)

    def same_tokens():
        out = model.generate(idx, 6, temperature=0, prompt_mask=mask, decode=decoder)
        return torch.equal(out, model.generate(idx, 6, temperature=0, prompt_mask=mask, decode="eager"))

    before = model.generate(idx, 6, temperature=0, prompt_mask=mask, decode="eager")
    assert same_tokens()
    with MatmulCount() as stacked, torch.no_grad():
        decoder.advance(decoder.tokens, decoder.pos.clone(), decoder.caches)
    caches = model.build_kv_caches(3, 12)
    model(idx, 0, caches)
    with MatmulCount() as separate, torch.no_grad():
        model(idx[:, :1], 7, caches)
    groups = decoder.projection_groups()[0]
    assert stacked.count == separate.count - 2 * sum(len(g) - 1 for g in groups.values())  # 2 layers
    with torch.no_grad():  # trained since: the next generation reads the new weights
        torch.manual_seed(1)
        for group in groups.values():
            group[-1].weight.add_(torch.randn_like(group[-1].weight))
    assert not torch.equal(before, model.generate(idx, 6, temperature=0, prompt_mask=mask, decode="eager"))
    assert same_tokens()
    attn = model.blocks[0].attn
    hooked = next(iter(attn.stackable().values()))[0]
    hooked.register_forward_hook(lambda module, args, out: out * 0.5)  # an adapter's path: a module of its own
    assert same_tokens() and model.blocks[0].attn.stackable() == {}


@pytest.mark.parametrize("name", NAMES)
def test_under_bf16_autocast_static_steps_choose_todays_tokens_up_to_rounding(name):
    """bf16 autocast, a padded batch: each static step's logits are the eager step's within bf16 rounding, so
    its greedy token is the eager one wherever the eager top two differ by more than the two paths' gap
    (a tie within rounding may go either way: the paths round in different orders)."""
    model = tiny(name, block_size=128)
    idx, mask = padded_batch()
    T0 = idx.shape[1]
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        decoder = StaticDecoder(model, 3, compile=True, backend="aot_eager", dtype=model.cache_dtype())
        caches = model.build_kv_caches(3, T0 + 12)
        padding = torch.cat([mask, torch.ones(3, 12, dtype=torch.bool)], dim=1)  # [3, T0 + 12]
        for cache in caches:
            cache.key_mask = padding
        static, eager = decoder.prefill(idx, mask).float(), model(idx, 0, caches)[:, -1].float()  # [3, V] each
        for t in range(12):
            torch.testing.assert_close(static, eager, rtol=0.02, atol=0.02)
            top2 = eager.topk(2).values  # [3, 2]
            sure = top2[:, 0] - top2[:, 1] > 2 * (static - eager).abs().max(-1).values  # [3]
            assert torch.equal(static.argmax(-1)[sure], eager.argmax(-1)[sure])
            tokens = eager.argmax(-1, keepdim=True)  # [3, 1], both paths continue alike
            static = decoder.step(tokens, T0 + t).float()
            eager = model(tokens, T0 + t, caches)[:, -1].float()
    assert {t.dtype for cache in decoder.caches for t in cache.tensors.values()} == {torch.bfloat16}


@pytest.mark.parametrize("name", ["mha", "tpa"])
def test_one_graph_per_bucket_never_per_token(name):
    model = tiny(name, block_size=600)
    prompt = torch.randint(0, 256, (2, MIN_BUCKET - 6))
    counter = CompileCounterWithBackend("aot_eager")
    decoder = StaticDecoder(model, 2, compile=True, backend=counter)
    out = model.generate(prompt, 20, temperature=0, decode=decoder)  # positions 250..268: buckets 256 and 512
    assert counter.frame_count == 2
    assert torch.equal(out, model.generate(prompt, 20, temperature=0, decode="eager"))
    model.generate(prompt[:, :100], 10, temperature=0, decode=decoder)  # bucket 256 again: replayed
    assert counter.frame_count == 2


def test_stopped_rows_read_back_every_few_steps_end_where_a_read_every_step_ends(monkeypatch):
    model = tiny("gqa")
    prompt = torch.randint(0, 256, (3, 4))
    greedy = model.generate(prompt, 20, temperature=0)
    stops = (int(greedy[0, 6]), int(greedy[1, 9]), int(greedy[2, 5]))
    every_step = model.generate(prompt, 20, temperature=0, stop_tokens=stops)
    monkeypatch.setattr(t6.model.t6, "stop_check_interval", lambda device_type: 8)
    assert torch.equal(model.generate(prompt, 20, temperature=0, stop_tokens=stops), every_step)
    assert every_step.shape[1] < 4 + 20  # every row stopped before the end


def test_decoding_choices_are_checked():
    model = tiny("mha")
    idx = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(
        ValueError, match="decode='fast' must be one of auto, eager, static, compiled or a StaticDecoder"
    ):
        model.generate(idx, 2, decode="fast")
    with pytest.raises(ValueError, match="2 prompts, but this decoder was built for batch_size=3"):
        model.generate(idx, 2, decode=StaticDecoder(model, 3, backend="eager"))
    with pytest.raises(ValueError, match="max_len=65 exceeds the model's block_size 64"):
        StaticDecoder(model, 2, max_len=65)
    assert model.static_decoder(2) is model.static_decoder(2) and model.static_decoder(2).max_len == 64


@pytest.mark.slow  # inductor generates and compiles C++ for each layer (tens of seconds on 2 cores)
def test_the_decode_benchmark_times_the_compiled_step_over_its_cache_bucket():
    from t6.bench.decode import measure
    from t6.model import ModelConfig

    base = dict(n_layer=1, d_model=64, head_dim=16, vocab_size=128, block_size=16, n_head=4)
    configs = {"mha": ModelConfig(attention="mha", **base), "tpa": ModelConfig(attention="tpa", **base)}
    records = measure(configs, [300], step="compiled", steps=2, rounds=1, warmup=2, verbose=False)
    assert [(r["attention"], r["step"], r["cache_view"]) for r in records] == [
        ("mha", "compiled", 301),  # the bucket of 301 tokens, capped at the cache's 301 positions
        ("tpa", "compiled", 301),
    ]
    assert fallback.events() == []  # inductor compiled both, FlexAttention included
    assert all(r["tokens_per_s"] > 0 for r in records)


@pytest.mark.slow  # inductor compiles each step's C++, twice where FlexAttention's CPU template fails (~30-50 s each)
@pytest.mark.parametrize("name", ["tpa_third_order", "tpa_nc_a"])
def test_a_step_inductor_cannot_compile_with_flex_attention_compiles_with_sdpa(name):
    """Inductor itself (not the eager backends above): torch 2.13's C++ FlexAttention template fails on these two
    ("too many values to unpack", "epilogue_nodes unsupported"); the step warns once, compiles with SDPA's masked
    attention instead, and generates the eager path's tokens."""
    model = tiny(name, block_size=64)
    idx, mask = padded_batch()
    out = model.generate(idx, 6, temperature=0, prompt_mask=mask, decode=StaticDecoder(model, 3, compile=True))
    assert torch.equal(out, model.generate(idx, 6, temperature=0, prompt_mask=mask, decode="eager"))
    assert [e.name for e in fallback.events()] == ["flex_decode"]


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and inductor's GPU kernels need a CUDA GPU")
@pytest.mark.parametrize("name", ["mha", "gqa", "tpa", "mla"])
def test_on_cuda_generate_replays_a_cuda_graph_with_todays_tokens(name):
    model = tiny(name, block_size=128).cuda()
    idx, mask = (t.cuda() for t in padded_batch())
    out = model.generate(idx, 40, temperature=0, prompt_mask=mask)  # decode="auto": the static decoder, graphed
    assert list(model.static_decoders) == [(3, torch.float32, idx.device, False)]
    assert torch.equal(out, model.generate(idx, 40, temperature=0, prompt_mask=mask, decode="eager"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="SDPA's cuDNN backend exists on CUDA only")
def test_on_cuda_inference_never_runs_cudnn_attention():
    model = tiny("gqa").cuda().to(torch.bfloat16)
    prompt = torch.randint(0, 256, (2, 9), device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model.generate(prompt, 4, temperature=0, decode="eager")
    names = {e.name for e in prof.events()}
    assert any("scaled_dot_product" in n for n in names) and not any("cudnn" in n for n in names)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_on_cuda_a_capture_that_fails_leaves_the_stream_and_random_numbers_working():
    """A capture whose step reads a value back fails; the thread's stream is the one it was, random numbers on
    the device are drawn again (a failed capture left the generator in capture mode: "Offset increment outside
    graph capture encountered unexpectedly"), and the same object captures a good step afterwards."""
    graphs = CudaGraphs("cuda")
    x = torch.ones(4, device="cuda")
    with graphs.warmup():
        x.sum().item()
    stream = torch.cuda.current_stream()
    with pytest.raises(Exception):
        graphs(lambda: x * x.sum().item())  # a host sync inside the capture
    assert torch.cuda.current_stream() == stream
    assert torch.randint(0, 10, (3,), device="cuda").shape == (3,)
    replay = graphs(lambda: x * 2)
    x.fill_(3)
    assert torch.equal(replay(), torch.full((4,), 6.0, device="cuda"))
