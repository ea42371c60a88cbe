"""Inference: KV caches per mechanism, decoding from TPA's factors, generation (batched,
padded, sampled) and the checkpoint-to-text path."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from t6.bench.common import compose
from t6.data.tokenizer import EOT
from t6.inference.generate import generate_text, generation_device
from t6.inference.generate import main as run
from t6.model import T6, ModelConfig
from t6.model.attention import available, get_attention_class
from t6.model.facts import kv_elements_per_token
from t6.model.load import load_model
from t6.model.t6 import left_pad
from t6.report.summary import summarize

NAMES = available()  # every registered mechanism
TPA = ["tpa", "tpa_kvonly"]


def tiny(name: str, seed: int = 0, n_head: int = 4, block_size: int = 64, **kw) -> T6:
    """A 2-layer model of mechanism `name` with its default options and random weights everywhere."""
    cfg = ModelConfig(attention=name, n_layer=2, d_model=64, n_head=n_head, vocab_size=256, block_size=block_size, **kw)
    torch.manual_seed(seed)
    model = T6(cfg)
    with torch.no_grad():  # residual outputs start at zero; randomize so every path matters
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model.eval()


def recompute_greedy(model: T6, prompt: torch.Tensor, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy decoding by full recomputation, no cache: tokens [B, T0 + n] and each step's logits [B, V]."""
    out, logits = prompt, []
    for _ in range(n):
        step = model(out)[:, -1]  # [B, V]
        logits.append(step)
        out = torch.cat([out, step.argmax(-1, keepdim=True)], dim=1)
    return out, logits


@pytest.mark.parametrize("name", NAMES)
def test_cached_greedy_generation_equals_recomputation_token_for_token(name):
    model = tiny(name)
    prompt = torch.randint(0, 256, (2, 7))
    ref, ref_logits = recompute_greedy(model, prompt, 10)
    assert torch.equal(model.generate(prompt, 10, temperature=0), ref)
    caches = model.build_kv_caches(2, 17)
    logits = model(prompt, 0, caches)[:, -1]
    for t in range(10):  # the logits of every cached step agree with recomputation
        torch.testing.assert_close(logits, ref_logits[t], rtol=1e-5, atol=1e-5)
        logits = model(ref[:, 7 + t : 8 + t], 7 + t, caches)[:, -1]


@pytest.mark.parametrize("name", NAMES)
def test_prefill_fills_the_caches_and_returns_the_last_positions_logits_alone(name):
    """T6.prefill: the LM head at the last position only (MLA and GLA attend explicitly, through SDPA's causal
    kernel, from position 0), the same logits as the whole forward, and caches a decode step continues from."""
    model = tiny(name)
    prompt = torch.randint(0, 256, (2, 9))
    caches = model.build_kv_caches(2, 10)
    logits = model.prefill(prompt, caches)  # [2, vocab]
    assert logits.shape == (2, model.cfg.vocab_size)
    torch.testing.assert_close(logits, model(prompt)[:, -1], rtol=1e-5, atol=1e-5)
    nxt = logits.argmax(-1, keepdim=True)  # [2, 1]
    full = torch.cat([prompt, nxt], dim=1)
    torch.testing.assert_close(model(nxt, 9, caches)[:, -1], model(full)[:, -1], rtol=1e-5, atol=1e-5)


def test_peak_memory_counts_each_storage_once_while_a_tensor_holds_it():
    from t6.inference.memory import PeakMemory

    with PeakMemory() as memory:
        a = torch.empty(1000)  # 4,000 B
        view = a.view(10, 100)  # the same storage
        del a
        b = torch.empty(500, dtype=torch.float64)  # 4,000 B: 8,000 alive
        del view, b
        c = torch.empty(10)
    assert (memory.peak, memory.now) == (8000, 40) and c.numel() == 10


@pytest.mark.slow  # each mechanism's whole medium prefill of 32k x 16 tokens traced on fake tensors (~3 s each)
@pytest.mark.parametrize("name", NAMES)
def test_a_32k_prompt_at_batch_16_fits_an_80_gb_gpu(name):
    """The generation benchmark's largest setting: medium, bf16, 16 prompts of 32k tokens and 128 new ones. Its peak,
    the prefill (weights, full caches, the largest moment of the prefill's transients), within the 78 GiB an H100
    reports. Before the prefill computed the last position's logits only, those alone took 52.8 GB; MLA's absorbed
    prefill held [B, h, T, S] scores (232 GiB at batch 1)."""
    from t6.bench.common import model_config_of
    from t6.inference.memory import generation_memory

    need = generation_memory(model_config_of(name, "medium"), 16, 32 * 1024, 128, torch.bfloat16)
    assert need["peak_bytes"] <= 78 * 2**30, {k: f"{v / 2**30:.1f} GiB" for k, v in need.items()}


class ScalarReads(TorchDispatchMode):
    """Counts tensor -> Python number reads (`int(t)`, `.item()`, `bool(t)`): on a GPU each one makes the
    host wait until the device has caught up, so a decode step holding one per layer is latency-bound."""

    supports_higher_order_operators = True  # flex_attention (fixed-shape decode steps)

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):  # its eager implementation, its reads counted here
            with self:
                return func.dispatch(torch._C.DispatchKey.CompositeExplicitAutograd, *args, **(kwargs or {}))
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", NAMES)
def test_a_decode_step_never_reads_a_tensor_back_to_the_host(name):
    model = tiny(name)
    padded = get_attention_class(name).supports_key_mask
    caches = model.build_kv_caches(2, 12)
    if padded:
        for cache in caches:
            cache.key_mask = torch.tensor([[False] * 3 + [True] * 9, [True] * 12])  # [B, 12]: a left-padded row
    model(torch.randint(0, 256, (2, 5)), 0, caches)  # prefill
    with ScalarReads() as reads:
        model(torch.randint(0, 256, (2, 1)), 5, caches)  # one decode step
        model(torch.randint(0, 256, (2, 3)), 6, caches)  # a few tokens at once (the eval adapter's continuations)
    assert reads.count == 0


@pytest.mark.parametrize("name", NAMES)
def test_under_autocast_the_cache_holds_the_compute_dtype_and_decoding_still_equals_recomputation(name):
    """Evaluation during bf16-mixed training runs under autocast with fp32 parameters: the caches hold
    bf16, what the layers compute, not fp32 copies that every step would cast back."""
    model = tiny(name)
    prompt = torch.randint(0, 256, (2, 7))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dtypes = {t.dtype for cache in model.build_kv_caches(2, 17) for t in cache.tensors.values()}
        ref, _ = recompute_greedy(model, prompt, 8)
        assert torch.equal(model.generate(prompt, 8, temperature=0), ref)
    assert dtypes == {torch.bfloat16}
    assert {t.dtype for cache in model.build_kv_caches(2, 17) for t in cache.tensors.values()} == {torch.float32}


@pytest.mark.parametrize("name", NAMES)
def test_allocated_cache_holds_the_declared_count_per_token(name):
    """The caches decoding writes hold exactly the mechanism's cache_spec per token: the count
    summary.py, the benchmarks and the reports print (t6.model.facts)."""
    model = tiny(name)
    expected = kv_elements_per_token(model.cfg)
    caches = model.build_kv_caches(3, 20)
    for cache in caches:
        assert all(t.shape[0] == 3 and t.shape[cache.seq_dims[n]] == 20 for n, t in cache.tensors.items())
        assert sum(t.numel() for t in cache.tensors.values()) == 3 * 20 * expected
    assert summarize(model.cfg, name, "test")["kv_cache_elements_per_token_per_layer"] == expected


@pytest.mark.parametrize("name", TPA)
@pytest.mark.parametrize("T", [1, 4])
def test_tpa_decode_from_factors_equals_materialized_k_and_v(name, T):
    model = tiny(name, n_head=5)
    attn = model.blocks[0].attn
    x = torch.randn(2, 19, model.cfg.d_model)
    cache = attn.build_kv_cache(2, 32)
    attn(x[:, : 19 - T], torch.arange(19 - T), cache)  # fill the cache with 19 - T tokens
    pos = torch.arange(19 - T, 19)
    q = attn.query_factors(x[:, -T:], pos)
    a_k, b_k = attn.k(x[:, -T:])
    a_v, b_v = attn.v(x[:, -T:])
    factors = cache.update(pos, a_k=a_k, b_k=attn.rope(b_k, pos), a_v=a_v, b_v=b_v)  # [B, 19, R, *] each
    for key_mask in (None, torch.rand(2, 32) > 0.3):
        cache.key_mask = key_mask
        fast = attn.attend_factors(q, *factors, pos, cache.attn_mask(pos))  # [B, T, h, d_h]
        slow = attn.attend_materialized(q, *factors, pos, cache)  # [B, T, h, d_h]
        torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)
    assert T <= attn.factor_decode_max_tokens  # forward() takes the factor path for these steps


@pytest.mark.parametrize("name", [n for n in NAMES if get_attention_class(n).supports_key_mask])
def test_batched_prompts_of_different_lengths_match_one_by_one(name):
    model = tiny(name)
    prompts = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 2], [11]]
    idx, mask = left_pad(prompts)
    out = model.generate(idx, 6, temperature=0, prompt_mask=mask)
    T0 = idx.shape[1]
    caches = model.build_kv_caches(3, T0 + 6)
    for cache in caches:
        cache.key_mask = torch.cat([mask, torch.ones(3, 6, dtype=torch.bool)], dim=1)
    padded_logits = model(idx, 0, caches)[:, -1]  # [3, V]
    for i, p in enumerate(prompts):
        alone = torch.tensor([p])
        ref, ref_logits = recompute_greedy(model, alone, 6)
        assert out[i, T0:].tolist() == ref[0, len(p) :].tolist()
        torch.testing.assert_close(padded_logits[i], ref_logits[0][0], rtol=1e-4, atol=1e-4)


def test_padding_mask_must_be_left_padding_and_supported(monkeypatch):
    model = tiny("mha")
    idx, mask = left_pad([[1, 2], [3]])
    with pytest.raises(ValueError, match="left padding"):
        model.generate(idx, 2, prompt_mask=mask.flip(1))
    monkeypatch.setattr(type(model.blocks[0].attn), "supports_key_mask", False)
    with pytest.raises(ValueError, match="does not honour padding masks"):
        model.generate(idx, 2, prompt_mask=mask)
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[1], []])


def test_sampling_settings_and_stop_tokens():
    model = tiny("tpa")
    prompt = torch.randint(0, 256, (3, 4))
    greedy = model.generate(prompt, 8, temperature=0)
    gen = torch.Generator().manual_seed(0)
    assert torch.equal(model.generate(prompt, 8, temperature=1.0, top_k=1, generator=gen), greedy)
    assert torch.equal(model.generate(prompt, 8, temperature=1.0, top_p=1e-6, generator=gen), greedy)
    sampled = model.generate(prompt, 8, temperature=5.0, top_k=3, generator=gen)
    for t in range(4, 12):  # every sampled token is among the 3 most likely at its step
        top3 = model(sampled[:, :t])[:, -1].topk(3).indices  # [B, 3]
        assert (top3 == sampled[:, t : t + 1]).any(-1).all()
    stop = int(greedy[0, 6])  # row 0 emits it at step 3 (or before)
    out = model.generate(prompt, 8, temperature=0, stop_tokens=(stop,))
    first = (out[0, 4:] == stop).nonzero()[0, 0] + 4
    assert (out[0, first:] == stop).all() and out.shape[1] <= 12
    with pytest.raises(ValueError, match="top_p=1.5"):
        model.generate(prompt, 2, top_p=1.5)
    with pytest.raises(ValueError, match="top_k=0"):
        model.generate(prompt, 2, top_k=0)


def test_decoding_past_the_cache_or_block_is_a_clear_error():
    model = tiny("mha")
    caches = model.build_kv_caches(1, 8)
    model(torch.zeros(1, 8, dtype=torch.long), 0, caches)
    with pytest.raises(ValueError, match="past the KV cache length 8"):
        model(torch.zeros(1, 1, dtype=torch.long), 8, caches)
    with pytest.raises(ValueError, match="exceeds block_size 64"):
        model.generate(torch.zeros(1, 60, dtype=torch.long), 10)


def write_checkpoint(model: T6, path) -> None:
    """The layout a T6LitModule checkpoint has (hyper_parameters.model_config, state_dict keys model.*)."""
    from dataclasses import asdict

    torch.save(
        {
            "hyper_parameters": {"model_config": asdict(model.cfg), "compile": False},
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        },
        path,
    )


def test_generate_entry_loads_the_model_on_the_device_asked_for(tmp_path, monkeypatch):
    cfg = ModelConfig(attention="mha", n_layer=1, d_model=64, n_head=4, vocab_size=50304, block_size=64)
    write_checkpoint(T6(cfg), tmp_path / "last.ckpt")
    seen = []
    monkeypatch.setattr(
        "t6.inference.generate.generate_text", lambda model, *args: seen.append(model.embed.weight.device) or []
    )
    run(compose("generate", [f"ckpt_path={tmp_path / 'last.ckpt'}", "device=meta", "max_new_tokens=8"]))
    assert seen == [torch.device("meta")]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device=cuda:1: this machine has no CUDA GPU"):
            run(compose("generate", [f"ckpt_path={tmp_path / 'last.ckpt'}", "device=cuda:1"]))


def test_generate_entry_loads_a_checkpoint_and_prints_text(tmp_path):
    cfg = ModelConfig(attention="mha", n_layer=2, d_model=64, n_head=4, vocab_size=50304, block_size=64)
    torch.manual_seed(0)
    model = T6(cfg).eval()
    write_checkpoint(model, tmp_path / "last.ckpt")
    loaded = load_model(tmp_path / "last.ckpt", device="cpu")
    for (k, v), (k2, v2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    texts = generate_text(loaded, ["ROMEO:", "First Citizen:\nWe are"], 5, temperature=0)
    assert texts[0].startswith("ROMEO:") and texts[1].startswith("First Citizen:\nWe are") and len(texts) == 2
    gen_cfg = compose(
        "generate",
        [
            f"ckpt_path={tmp_path / 'last.ckpt'}",
            "max_new_tokens=4",
            "temperature=0",
            "prompt=[ROMEO:,JULIET:]",
            "device=cpu",
        ],
    )
    assert run(gen_cfg)[:1] == generate_text(loaded, ["ROMEO:"], 4, temperature=0)
    default = compose("generate", [f"ckpt_path={tmp_path / 'last.ckpt'}"]).device
    assert default == "auto" and generation_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(FileNotFoundError, match="ckpt_path="):
        load_model(tmp_path / "missing.ckpt")
    torch.save({"state_dict": {}}, tmp_path / "bad.ckpt")
    with pytest.raises(ValueError, match="not a T6 checkpoint"):
        load_model(tmp_path / "bad.ckpt")
    assert EOT == 50256
