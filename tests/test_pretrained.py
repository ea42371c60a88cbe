"""Pretrained Llama models read by the one loader as T6s, exactly (fp32 logits equal transformers'),
with their tokenizer; what T6 cannot express is refused naming the config field."""

from __future__ import annotations

import json

import pytest
import torch

from t6.data.tokenizer import checkpoint_tokenizer, load_tokenizer
from t6.model.layers import rope_frequencies
from t6.model.load import load_model, read_checkpoint

from tiny_llama import EOS, VOCAB, random_llama, save_gguf, save_llama_directory, tiny_tokenizer


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama")
    return out, save_llama_directory(out)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return save_gguf(tmp_path_factory.mktemp("gguf"))


def tokens(n: int = 100, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(0))


def test_a_llama_directory_is_a_t6_with_transformers_logits(llama_dir):
    path, hf = llama_dir
    model = load_model(path)
    cfg = model.cfg
    assert (cfg.attention, cfg.attention_options, cfg.n_head, cfg.head_dim) == (
        "gqa",
        {"output_gate": "none", "n_kv_head": 2},
        4,
        24,
    )
    assert (cfg.ffn_hidden, cfg.rope_theta, cfg.norm_eps, cfg.tie_embeddings) == (99, 500000.0, 1e-5, False)
    assert cfg.rope_remap["rope_type"] == "llama3" and cfg.rope_remap["original_max_position_embeddings"] == 16
    idx = tokens()
    with torch.no_grad():
        got, want = model(idx), hf(idx).logits
    assert (got - want).abs().max() < 1e-5
    # the rope scaling is in the tables: without it the logits differ
    plain = load_model(path)
    for block in plain.blocks:
        rope = block.attn.rope
        angles = torch.outer(torch.arange(rope.max_len, dtype=torch.float32), rope_frequencies(24, 500000.0))
        rope.cos.copy_(angles.cos()), rope.sin.copy_(angles.sin())
    with torch.no_grad():
        assert (plain(idx) - want).abs().max() > 1e-3


def test_rope_frequencies_are_transformers_llama3_remap():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = random_llama().config
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    got = rope_frequencies(24, 500000.0, config.rope_parameters)
    assert torch.equal(got, want)
    assert not torch.equal(got, rope_frequencies(24, 500000.0))


@pytest.mark.parametrize("kv_heads, attention", [(4, "mha"), (1, "mqa")])
def test_kv_heads_choose_the_mechanism(tmp_path, kv_heads, attention):
    hf = save_llama_directory(tmp_path, num_key_value_heads=kv_heads)
    model = load_model(tmp_path)
    assert model.cfg.attention == attention
    idx = tokens(40, 1)
    with torch.no_grad():
        assert (model(idx) - hf(idx).logits).abs().max() < 1e-5


def test_a_gguf_file_is_a_t6_with_transformers_logits(gguf_file):
    from transformers import AutoModelForCausalLM

    path, written = gguf_file
    ckpt = read_checkpoint(path)
    assert ckpt["source"]["format"] == "gguf" and ckpt["model_config"]["tie_embeddings"]
    model = load_model(path)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    idx = tokens()
    with torch.no_grad():
        got = model(idx)
        assert (got - hf(idx).logits).abs().max() < 1e-5
        assert (got - written(idx).logits).abs().max() < 1e-5  # llama.cpp's permutation undone
    assert model.lm_head.weight is model.embed.weight


def test_the_tokenizer_comes_with_the_model(llama_dir, gguf_file):
    text = "ROMEO:\nBut soft, what light through yonder window breaks?"
    want = tiny_tokenizer().encode(text).ids
    for path in (llama_dir[0], gguf_file[0]):
        tok = checkpoint_tokenizer(read_checkpoint(path))
        assert tok.encode(text) == want and tok.decode(want) == text
        assert tok.eot == tiny_tokenizer().token_to_id(EOS) and VOCAB <= tok.n_vocab <= 401  # GGUF: padded list
        assert load_tokenizer(path) == tok  # the tokenizer= setting reads the same


@pytest.mark.parametrize(
    "change, field",
    [
        ({"attention_bias": True}, "attention_bias=True"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"sliding_window": 64}, "sliding_window=64"),
        ({"num_local_experts": 8}, "num_local_experts=8"),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
            "rope_parameters.rope_type='yarn'",
        ),
        (
            {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_parameters": None},
            "rope_scaling.rope_type='linear'",
        ),
        ({"model_type": "mistral"}, "model_type='mistral'"),
    ],
)
def test_what_t6_cannot_express_is_refused_naming_the_field(tmp_path, change, field):
    save_llama_directory(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace("[", r"\[")):
        read_checkpoint(tmp_path)


def test_old_style_rope_keys_are_read(tmp_path):
    """config.json from before transformers 5: rope_theta and rope_scaling at the top level."""
    hf = save_llama_directory(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(config))
    idx = tokens(60, 1)
    with torch.no_grad():
        assert (load_model(tmp_path)(idx) - hf(idx).logits).abs().max() < 1e-5
