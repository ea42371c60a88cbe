"""Tiny random Llama models written the ways pretrained models ship: a Hugging Face directory saved by
transformers, and a GGUF file written with the `gguf` package (as llama.cpp's converter writes one),
each with a small byte-level BPE tokenizer trained here on the shipped corpus."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch

from t6.data.corpus import TINY_SHAKESPEARE

VOCAB = 384  # the tokenizer's tokens (the model's embedding has a few more rows, as real models pad)
MODEL_VOCAB = 400
EOS, BOS = "</s>", "<s>"
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"  # no pad token


@functools.cache
def trained_tokenizer() -> str:
    """The tokenizer's JSON, trained once per session."""
    return _train().to_str()


def tiny_tokenizer():
    """A fresh copy of the session's trained tokenizer."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(trained_tokenizer())


def _train():
    """A byte-level BPE of VOCAB tokens (special tokens <s>=0 and </s>=1) trained on the corpus's start."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=[BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TINY_SHAKESPEARE.read_text()[:100_000]], trainer)
    return tok


def llama_config(**overrides):
    """Untied head, GQA (4 query heads, 2 KV heads), head_dim 24 != 64 / 4, an odd SwiGLU width, rope_theta
    5e5 with Llama 3's rope scaling (an original context short enough for the remap to matter here)."""
    from transformers import LlamaConfig

    settings = dict(
        vocab_size=MODEL_VOCAB,
        hidden_size=64,
        intermediate_size=99,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def random_llama(seed: int = 0, **overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(**overrides)).eval()
    with torch.no_grad():  # transformers' init leaves norms at one: randomize them too, so every weight matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def save_llama_directory(out: Path, seed: int = 0, **overrides):
    """A Hugging Face directory (config.json model_type llama, model.safetensors, tokenizer.json); returns
    the transformers model."""
    from transformers import PreTrainedTokenizerFast

    model = random_llama(seed, **overrides)
    model.save_pretrained(out)
    PreTrainedTokenizerFast(
        tokenizer_object=tiny_tokenizer(), bos_token=BOS, eos_token=EOS, chat_template=CHAT_TEMPLATE
    ).save_pretrained(out)
    return model


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of a query/key projection (which transformers undoes)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def save_gguf(out: Path, seed: int = 0) -> tuple[Path, object]:
    """A GGUF file of a random Llama (F32 tensors, tied head, plain RoPE: what GGUF's llama metadata carries)
    with its BPE vocabulary; returns (the file, the transformers model it holds)."""
    import gguf

    model = random_llama(seed, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e5})
    cfg = model.config
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tiny-llama.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(1e5)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    vocab = json.loads(tiny_tokenizer().to_str())["model"]
    tokens = sorted(vocab["vocab"], key=vocab["vocab"].get)
    tokens += [f"<pad{i}>" for i in range(cfg.vocab_size - len(tokens))]  # the embedding's extra rows
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in (BOS, EOS) else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in vocab["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(False)
    state = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    h, g = cfg.num_attention_heads, cfg.num_key_value_heads
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(cfg.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            w = state[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name in ("attn_q", "attn_k"):
                w = llama_cpp_permute(w, h if gguf_name == "attn_q" else g)
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, model
