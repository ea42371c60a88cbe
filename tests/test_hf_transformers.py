"""The export behaves like transformers' own causal LMs, for every registered mechanism: its cache continues
(`cache`, formerly `past_key_values`; generate() from a returned cache, prompt-lookup and assisted decoding), any 2D
attention mask, hidden states, attentions, inputs_embeds, gradient checkpointing, missing weights, resized embeddings,
and PEFT LoRA on every projection, training and cached paths alike. The classes are the export's own
(remote code, `hf_classes`), on very small random models."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from t6.model.attention import available

from conftest import hf_config, tiny_model_config

NAMES = available()


@pytest.fixture(scope="module")
def build(hf_classes, tmp_path_factory):
    """build(attention, seed=0, **config) -> an exported T6ForCausalLM of that mechanism, random weights, eval mode."""
    config_class, model_class = hf_classes
    root = tmp_path_factory.mktemp("configs")
    configs = {}

    def make(attention: str, seed: int = 0, **extra):
        if attention not in configs:
            configs[attention] = tiny_model_config(root, attention)
        torch.manual_seed(seed)
        model = model_class(hf_config(config_class, configs[attention], **extra))
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.1)
        return model.eval()

    return make


def tokens(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 98, shape, generator=torch.Generator().manual_seed(seed))  # below the pad id, 98


@pytest.mark.parametrize("name", NAMES)
def test_the_cache_continues_as_transformers_models_do(build, name):
    """model(ids, cache=cache) continues the returned cache (it grows: the first call allocated 10
    positions), generate() continues from the cache it returned, prompt-lookup decoding gives the greedy tokens,
    and crop() forgets tokens."""
    hf = build(name)
    ids = tokens(2, 24)
    with torch.no_grad():
        full = hf(ids, use_cache=False).logits  # [2, 24, V]
        first = hf(ids[:, :10])
        assert first.cache is not None and first.cache.get_seq_length() == 10  # config.use_cache: a cache by default
        more = hf(ids[:, 10:20], cache=first.cache)
        last = hf(ids[:, 20:], cache=more.cache, attention_mask=torch.ones(2, 24))
        torch.testing.assert_close(torch.cat([first.logits, more.logits, last.logits], 1), full, rtol=0, atol=2e-5)
        last.cache.crop(-4)  # forget the last 4 tokens, then write them again
        with pytest.warns(FutureWarning, match="`past_key_values` is deprecated"):  # the former name still works
            again = hf(ids[:, 20:], past_key_values=last.cache)
        torch.testing.assert_close(again.logits, full[:, 20:], rtol=0, atol=2e-5)

        greedy = dict(do_sample=False, pad_token_id=98)
        want = hf.generate(ids[:1, :6], max_new_tokens=12, **greedy)
        part = hf.generate(ids[:1, :6], max_new_tokens=5, return_dict_in_generate=True, **greedy)
        rest = hf.generate(part.sequences, cache=part.cache, max_new_tokens=7, **greedy)
        assert torch.equal(rest, want)
        assert torch.equal(hf.generate(ids[:1, :6], max_new_tokens=12, prompt_lookup_num_tokens=3, **greedy), want)


def differential(calls: list) -> tuple[torch.Tensor, torch.Tensor]:
    """DIFF's layer: two maps, each over both halves of V, recorded as (K1, V_a), (K1, V_b), (K2, V_a), (K2, V_b); its
    keys are the maps' side by side [B, 2h, S, d], its values the halves side by side [B, 2h, S, d]."""
    assert len(calls) == 4, len(calls)
    return torch.cat([calls[0][0], calls[2][0]], dim=1), torch.cat([calls[0][1], calls[1][1]], dim=1)


@pytest.mark.parametrize("name", NAMES)
def test_cache_layers_keys_and_values_are_what_the_attention_uses(build, name, monkeypatch):
    """Every cache layer has transformers' `keys` [B, h_kv, S, d_k] and `values` [B, h_kv, S, d_v]: exactly the K and
    V each layer's attention scored and averaged over the whole sequence (its written-out path hands them to
    Attention.record_attention), whether the cache was filled by one prefill or by cached decoding (the factor,
    absorbed and fused paths, the cache growing); after crop and beam reordering, those of the tokens it holds. GQA's
    are its cache itself."""
    hf, ids = build(name), tokens(2, 20)
    used = [[] for _ in hf.model.blocks]  # (k, v) of each written-out attention, per layer
    for block, calls in zip(hf.model.blocks, used):
        record = block.attn.record_attention

        def spy(q, k, v, mask, scale=None, record=record, calls=calls):
            calls.append((k, v))
            return record(q, k, v, mask, scale)

        monkeypatch.setattr(block.attn, "record_attention", spy)
    with torch.no_grad():
        whole = hf(ids, output_attentions=True).cache  # one prefill of the 20 tokens
    prefill = [calls[0] if len(calls) == 1 else differential(calls) for calls in used]
    with torch.no_grad():
        decoded = hf(ids[:, :6]).cache  # 6 tokens, then 1, 3 and 1 at a time: the cache grows from 6 to 12 to 20
        for chunk in (slice(6, 7), slice(7, 10), slice(10, 11), slice(11, 20)):
            hf(ids[:, chunk], cache=decoded)
    for cache in (whole, decoded):
        for layer, (k, v) in zip(cache.layers, prefill, strict=True):
            assert layer.keys.shape[:3] == layer.values.shape[:3] == (2, k.shape[1], 20)
            torch.testing.assert_close(layer.keys, k, rtol=0, atol=1e-6)
            torch.testing.assert_close(layer.values, v, rtol=0, atol=1e-6)
    layer, (k, v) = decoded.layers[0], prefill[0]
    decoded.crop(-5)
    torch.testing.assert_close(layer.keys, k[:, :, :15], rtol=0, atol=1e-6)
    decoded.reorder_cache(torch.tensor([1, 0]))
    torch.testing.assert_close(layer.values, v[[1, 0], :, :15], rtol=0, atol=1e-6)
    if name in ("mha", "gqa", "mqa"):  # a K/V cache: the tensors decoding reads
        assert layer.keys.data_ptr() == layer.kv.tensors["k"].data_ptr()


@pytest.mark.parametrize("name", ["mha", "tpa", "mla"])  # SDPA over K/V heads, TPA's factors, MLA's latent
def test_assisted_decoding_gives_the_greedy_tokens(build, name):
    """A draft model (another T6) proposes tokens; each layer's cache is cropped back to the accepted ones."""
    hf, assistant, prompt = build(name), build(name, seed=1), tokens(1, 6)
    greedy = dict(do_sample=False, pad_token_id=98, max_new_tokens=12)
    with torch.no_grad():
        assert torch.equal(hf.generate(prompt, assistant_model=assistant, **greedy), hf.generate(prompt, **greedy))


@pytest.mark.parametrize("name", NAMES)
def test_any_2d_mask_hides_the_padding(build, name):
    """Right padding, left padding and gaps: no real token sees a padding position (changing the padding's
    tokens changes nothing at the real ones), right padding computes what the row alone does, and generate()
    takes such prompts."""
    hf = build(name)
    ids = tokens(3, 12)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, 9:] = 0  # right padding
    mask[1, :4] = 0  # left padding
    mask[2, 3:6] = 0  # a gap
    other = torch.where(mask.bool(), ids, tokens(3, 12, seed=7))  # other tokens at the padding
    real = mask.bool()
    with torch.no_grad():
        got = hf(ids, attention_mask=mask).logits
        torch.testing.assert_close(got[real], hf(other, attention_mask=mask).logits[real], rtol=0, atol=2e-5)
        torch.testing.assert_close(got[0, :9], hf(ids[:1, :9]).logits[0], rtol=0, atol=2e-5)
        greedy = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=98)
        new = hf.generate(ids, **greedy)[:, 12:]  # a right-padded prompt continues from its last (padding) position
        assert torch.equal(new[1:], hf.generate(other, **greedy)[1:, 12:])
        shifted = torch.arange(12).expand(3, 12) - 4  # a row's positions shifted by a constant: RoPE keeps distances
        torch.testing.assert_close(hf(ids, position_ids=shifted).logits, hf(ids).logits, rtol=0, atol=2e-5)
        with pytest.raises(ValueError, match="position_ids: a T6 places each token at its index"):
            hf(ids, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), attention_mask=mask)
        with pytest.raises(ValueError, match=r"attention_mask has shape \(3, 11\); a T6 takes a 2D mask"):
            hf(ids, attention_mask=mask[:, 1:])


def test_hidden_states_attentions_and_inputs_embeds(build):
    """hidden_states: the embeddings, each block's output, the last normalized (the head's input); attentions:
    each layer's causal probabilities, zero at padding; inputs_embeds computes what input_ids do."""
    for name in ("mha", "tpa", "mla"):  # the three ways attention is computed: SDPA, TPA's factors, MLA's latent
        hf = build(name)
        ids, mask = tokens(2, 9), torch.ones(2, 9, dtype=torch.long)
        mask[1, :3] = 0
        with torch.no_grad():
            out = hf(ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
            embeds = hf(inputs_embeds=hf.get_input_embeddings()(ids), attention_mask=mask).logits
            cached = hf(ids[:, -1:], cache=hf(ids[:, :-1], attention_mask=mask[:, :-1]).cache,
                        attention_mask=mask, output_attentions=True)  # fmt: skip
        n_layer, n_head = hf.config.n_layer, hf.config.n_head
        assert len(out.hidden_states) == n_layer + 1 and torch.equal(out.hidden_states[0], hf.model.embed(ids))
        torch.testing.assert_close(hf.model.lm_head(out.hidden_states[-1]), out.logits, rtol=0, atol=1e-6)
        torch.testing.assert_close(embeds, out.logits, rtol=0, atol=1e-6)
        assert len(out.attentions) == n_layer and out.attentions[0].shape == (2, n_head, 9, 9)
        for probs in (*out.attentions, *cached.attentions):
            torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]))
            assert float(probs[1, :, -1, :3].abs().max()) == 0  # padding unseen
        assert float(out.attentions[0].triu(1).abs().max()) == 0  # causal
        torch.testing.assert_close(cached.attentions[0][:, :, 0], out.attentions[0][:, :, -1], rtol=0, atol=1e-5)


def test_attn_implementation_maps_onto_t6s_own_attention(build, hf_classes, tmp_path, monkeypatch):
    """from_pretrained(attn_implementation=...) as TRL and lm-eval pass it: sdpa (the default) runs each mechanism's
    kernels, eager the attention written out (no SDPA call, no fused operator), with the same logits and greedy
    tokens; flash_attention_2 runs as sdpa; set_attn_implementation switches; anything else (transformers' flex and
    paged attention, a Hub kernel) is refused, naming it, before it is looked for."""
    _, model_class = hf_classes
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []
    monkeypatch.setattr(
        torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k)
    )
    ids, mask = tokens(2, 9), torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    greedy = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=98)
    for name in ("mha", "tpa", "mla"):
        build(name).save_pretrained(tmp_path / name)
        out = {}
        for asked, runs in ((None, "sdpa"), ("eager", "eager"), ("flash_attention_2", "sdpa")):
            hf = model_class.from_pretrained(tmp_path / name, **({"attn_implementation": asked} if asked else {}))
            assert hf.config._attn_implementation == runs
            calls.clear()
            with torch.no_grad():
                out[asked] = hf(ids, attention_mask=mask).logits, hf.generate(ids, **greedy)
            if name != "mla":  # padded, MLA attends through its absorbed form and fused operator, not SDPA
                assert bool(calls) == (runs == "sdpa")
        torch.testing.assert_close(out["eager"][0], out[None][0], rtol=0, atol=1e-5)
        assert torch.equal(out["eager"][1], out[None][1]) and torch.equal(out["flash_attention_2"][1], out[None][1])
    hf.set_attn_implementation("eager")
    assert hf.config._attn_implementation == "eager"
    for refused in ("flex_attention", "paged|eager", "kernels-community/flash-attn2", "kernels-community/sdpa"):
        with pytest.raises(
            ValueError, match=f'Specified `attn_implementation="{re.escape(refused)}"` is not supported by a T6'
        ):
            model_class.from_pretrained(tmp_path / "mha", attn_implementation=refused)
        with pytest.raises(ValueError, match=f'attn_implementation="{re.escape(refused)}"'):
            hf.set_attn_implementation(refused)


def test_generation_past_block_size_is_refused_before_it_starts(build):
    """generate() whose prompt + max_new_tokens (or max_length) passes the model's block_size (64) is an error naming
    them, before any forward; exactly block_size tokens generate."""
    hf = build("tpa")
    forwards = []
    hf.model.embed.register_forward_hook(lambda *_: forwards.append(1))
    greedy = dict(do_sample=False, pad_token_id=98)
    too_long = r"prompt \(60 tokens\) \+ max_new_tokens \(5\) = 65 tokens exceeds the model's block_size \(max_position"
    with pytest.raises(ValueError, match=too_long + r"_embeddings\) 64; lower max_new_tokens or shorten the prompt"):
        hf.generate(tokens(1, 60), max_new_tokens=5, **greedy)
    with pytest.raises(ValueError, match=r"max_length = 70 tokens exceeds the model's block_size"):
        hf.generate(tokens(1, 60), max_length=70, **greedy)
    assert not forwards
    assert hf.generate(tokens(1, 60), max_new_tokens=4, **greedy).shape == (1, 64)


def test_labels_and_shift_labels_give_the_causal_lm_loss(build):
    """labels are shifted by the model (transformers' causal-LM loss); shift_labels, already aligned (sequence-parallel
    trainers pass them), are used as they are, labels then ignored."""
    hf = build("gqa")
    ids, other = tokens(2, 9), tokens(2, 9, seed=3)
    shifted = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)  # [2, 9], the last position has no target
    with torch.no_grad():
        out = hf(ids, labels=ids)
        want = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        torch.testing.assert_close(out.loss, want)
        torch.testing.assert_close(hf(ids, labels=other, shift_labels=shifted).loss, want)
        assert not torch.allclose(hf(ids, labels=ids, shift_labels=other).loss, want)


def test_output_attentions_of_a_mechanism_that_records_none_is_an_error(build, monkeypatch):
    hf = build("gqa")
    attn = type(hf.model.blocks[0].attn)
    monkeypatch.setattr(attn, "record_attention", lambda self, q, k, v, mask, scale=None: attn.__mro__[1].attend)
    monkeypatch.setattr(attn, "attend", lambda self, q, k, v, pos, cached: q)  # an attention that records nothing
    with pytest.raises(NotImplementedError, match=r"output_attentions: attention='gqa' \(GroupedQueryAttention\) does"):
        hf(tokens(1, 5), output_attentions=True)


@pytest.mark.parametrize(
    "reentrant, attn_implementation, output_attentions",
    [(False, "sdpa", False), (True, "sdpa", False), (False, "eager", False), (False, "sdpa", True)],
)
def test_gradient_checkpointing_applies_transformers_kwargs_to_each_block(
    build, reentrant, attn_implementation, output_attentions
):
    """Each block is a transformers GradientCheckpointingLayer: activation_checkpointing_enable() recomputes it in
    backward through torch's checkpoint with the given kwargs (use_reentrant: the block's output comes from
    CheckpointFunction, or not), every_n_layers=2 every other block, and the gradients are the plain ones; a block
    whose attention is written out (eager, output_attentions) is recomputed written out too."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    hf = build("tpa", n_layer=4, attn_implementation=attn_implementation).train()
    assert all(isinstance(block, GradientCheckpointingLayer) for block in hf.model.blocks)
    ids = tokens(2, 12)
    runs, outputs = [], []
    for block in hf.model.blocks:
        block.ffn.register_forward_pre_hook(lambda *_: runs.append(1))  # inside the block: runs again in backward
        block.register_forward_hook(lambda module, args, out: outputs.append(out))  # outside the checkpoint

    def grads() -> dict[str, torch.Tensor]:
        hf.zero_grad()
        runs.clear(), outputs.clear()
        hf(ids, labels=ids, output_attentions=output_attentions).loss.backward()
        return {n: p.grad.clone() for n, p in hf.named_parameters()}

    plain = grads()
    assert len(runs) == 4 and not hf.is_activation_checkpointing
    for every, recomputed in ((1, 4), (2, 2)):
        hf.activation_checkpointing_enable({"use_reentrant": reentrant}, every_n_layers=every)
        assert hf.is_activation_checkpointing
        checkpointed = grads()
        assert len(runs) == 4 + recomputed  # each checkpointed block once more, in backward
        kinds = [type(out.grad_fn).__name__ == "CheckpointFunctionBackward" for out in outputs]
        assert kinds == [reentrant and i % every == 0 for i in range(4)]
        for name, grad in plain.items():
            torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-7)
        hf.activation_checkpointing_disable()
        assert not any(getattr(m, "gradient_checkpointing", False) for m in hf.modules())


def test_missing_weights_are_initialized_as_t6_does_and_reported(build, hf_classes, tmp_path):
    """A checkpoint without the final norm and the embedding: the norm is ones, the embedding N(0, init_std)
    (not meta, not garbage), both reported missing; a vocabulary of another size with ignore_mismatched_sizes
    re-makes the embedding N(0, init_std) too."""
    _, model_class = hf_classes
    hf = build("mla")
    hf.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.norm.weight"], weights["model.embed.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded, info = model_class.from_pretrained(tmp_path, output_loading_info=True)
    assert {"model.norm.weight", "model.embed.weight"} <= set(info["missing_keys"])
    assert torch.equal(loaded.model.norm.weight, torch.ones_like(loaded.model.norm.weight))
    embed = loaded.model.embed.weight
    assert embed.device.type == "cpu" and abs(float(embed.std()) - hf.config.init_std) < 0.004
    assert loaded.model.lm_head.weight is embed
    assert torch.equal(loaded.model.blocks[0].attn.kv_up.weight, hf.model.blocks[0].attn.kv_up.weight)  # loaded
    assert torch.isfinite(loaded(tokens(1, 8)).logits).all()

    hf.save_pretrained(tmp_path / "full")
    resized = model_class.from_pretrained(tmp_path / "full", vocab_size=120, ignore_mismatched_sizes=True)
    assert resized.model.embed.weight.shape[0] == 120
    assert abs(float(resized.model.embed.weight.std()) - hf.config.init_std) < 0.004


def test_token_embeddings_resize_tied_and_untied(build):
    for tie in (True, False):
        hf = build("tpa", tie_embeddings=tie)
        assert (hf.get_output_embeddings() is hf.model.lm_head) and (hf.get_input_embeddings() is hf.model.embed)
        hf.resize_token_embeddings(120)
        assert hf.model.embed.weight.shape == hf.model.lm_head.weight.shape == (120, hf.config.d_model)
        assert (hf.model.lm_head.weight is hf.model.embed.weight) == tie and hf.config.vocab_size == 120
        assert hf(torch.tensor([[119, 3, 5]])).logits.shape == (1, 3, 120)
        head = torch.nn.Linear(hf.config.d_model, 120, bias=False)
        hf.set_output_embeddings(head)
        assert hf.get_output_embeddings() is head


@pytest.mark.parametrize("name", NAMES)
def test_peft_lora_acts_on_every_path(build, name):
    """PEFT LoRA on every projection the mechanism has (its factor maps, latent up-projections, contextual maps),
    the feed-forward and the head: every adapter gets a gradient from the training forward, the adapted model
    equals the merged one (training path, cached decoding, T6's own loss), and cached decoding equals the full
    forward."""
    from peft import LoraConfig, get_peft_model

    hf = build(name, tie_embeddings=False)  # a LoRA merged into a tied head would change the embedding too
    projections = [n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear)]
    config = LoraConfig(r=2, lora_alpha=4, target_modules=projections, init_lora_weights=False)  # B random: acts
    peft = get_peft_model(hf, config)
    assert {n for n, m in hf.named_modules() if hasattr(m, "lora_A")} == set(projections)  # every projection

    ids = tokens(2, 10)
    peft.train()
    peft(ids, labels=ids).loss.backward()
    lora = {n: p for n, p in peft.named_parameters() if "lora_" in n}
    assert lora and all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in lora.values()), [
        n for n, p in lora.items() if p.grad is None or float(p.grad.abs().sum()) == 0
    ]

    peft.eval()
    with torch.no_grad():
        full = peft(ids, use_cache=False).logits
        first = peft(ids[:, :6])
        step = peft(ids[:, 6:7], cache=first.cache)
        rest = peft(ids[:, 7:], cache=step.cache)
        cached = torch.cat([first.logits, step.logits, rest.logits], dim=1)
        t6_loss = peft.base_model.model.model(ids, targets=ids)  # T6's own loss through the adapted head
        peft.merge_adapter()
        merged = peft(ids, use_cache=False).logits
    torch.testing.assert_close(cached, full, rtol=0, atol=5e-5)
    torch.testing.assert_close(merged, full, rtol=0, atol=5e-5)
    torch.testing.assert_close(t6_loss, F.cross_entropy(full.flatten(0, 1), ids.flatten()), rtol=0, atol=1e-5)
