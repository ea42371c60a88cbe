"""Pretrained Llama-architecture models read as T6s: a Hugging Face directory (`config.json` with
`model_type: llama`, safetensors), a GGUF file, or a Hub id (downloaded where the network allows).

A Llama is a T6 whose attention is grouped-query: `mha`, `gqa` or `mqa` by its KV heads. Its weights
map name for name (below); RoPE rotates halves in both (Hugging Face's `rotate_half`, T6's `Rotary`),
so the query and key projections load as they are; `rope_theta`, Llama 3's `rope_scaling` (ModelConfig's
`rope_remap`), the norm's eps, the SwiGLU width, head_dim and an untied head are ModelConfig fields. Whatever T6 cannot
express (biases, sliding windows, other rope types, mixtures of experts, other architectures) is
refused, naming the config field.

A GGUF file is read through transformers (`from_pretrained(folder, gguf_file=name)`, which
dequantizes with the `gguf` package and undoes llama.cpp's query/key permutation); the T6 gets the
dequantized weights, so its logits are transformers' own. The tokenizer comes with the model: the
source record names the directory or file it is read from (t6.data.tokenizer.checkpoint_tokenizer).

`read_pretrained` returns what t6.model.load.read_checkpoint returns for a T6 export (which adds its
`format`): a warm-start checkpoint's keys (`model_config`, `state_dict`, `source`).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from t6.errors import DamagedFile, MissingFile, SettingError
from t6.model.config import ModelConfig

LLAMA = "llama"
GGUF_SUFFIX = ".gguf"
# Hugging Face Llama parameter names -> T6's ({i}: the layer)
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn.q.weight",
    "self_attn.k_proj.weight": "attn.k.weight",
    "self_attn.v_proj.weight": "attn.v.weight",
    "self_attn.o_proj.weight": "attn.out.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn.gate.weight",
    "mlp.up_proj.weight": "ffn.up.weight",
    "mlp.down_proj.weight": "ffn.down.weight",
}
TOP_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
# Settings T6 cannot express: (config field, whether a value is refused, what T6 has instead)
UNSUPPORTED = (
    ("attention_bias", bool, "no bias in the query/key/value/output projections"),
    ("mlp_bias", bool, "no bias in the SwiGLU projections"),
    ("sliding_window", lambda v: v is not None, "full causal attention in every layer"),
    ("use_sliding_window", bool, "full causal attention in every layer"),
    ("layer_types", lambda v: v is not None and any(t != "full_attention" for t in v), "full attention in every layer"),
    ("num_local_experts", bool, "one dense SwiGLU per layer, no mixture of experts"),
    ("num_experts", bool, "one dense SwiGLU per layer, no mixture of experts"),
    ("n_routed_experts", bool, "one dense SwiGLU per layer, no mixture of experts"),
    ("qk_norm", bool, "no normalization of queries and keys"),
    ("attn_logit_softcapping", lambda v: v is not None, "uncapped attention logits"),
    ("final_logit_softcapping", lambda v: v is not None, "uncapped output logits"),
)


def is_pretrained(path: Path) -> bool:
    """Whether path names a model this module reads: a GGUF file or a directory of a Llama."""
    if path.is_file():
        return path.suffix.lower() == GGUF_SUFFIX
    config = path / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("model_type") != "t6"
    except (OSError, ValueError, AttributeError):
        return False


def is_hub_id(spec: str) -> bool:
    """`owner/name`: how a model on the Hugging Face Hub is named (and no local file)."""
    parts = str(spec).split("/")
    return len(parts) == 2 and all(parts) and not Path(spec).expanduser().exists() and not str(spec).startswith(".")


def rope_settings(config: dict[str, Any], what: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of a Llama config, in transformers 5's `rope_parameters` or the older
    `rope_theta` / `rope_scaling` keys; any rope type but the default and llama3 is refused."""
    params = dict(config.get("rope_parameters") or {})
    scaling = params if params else dict(config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "llama3"):
        field = "rope_parameters.rope_type" if params else "rope_scaling.rope_type"
        raise SettingError(
            f"{what}: {field}={kind!r} is a RoPE variant T6 does not implement (it has plain RoPE and Llama 3's "
            "llama3 remap)"
        )
    if float(scaling.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise SettingError(f"{what}: partial_rotary_factor != 1: T6 rotates every dimension of a head")
    return theta, (scaling if kind == "llama3" else None)


def llama_model_config(config: dict[str, Any], what: str, where: str = "config.json") -> ModelConfig:
    """The ModelConfig of a Llama's config.json (or transformers' LlamaConfig as a dict); a setting T6
    cannot express is a ValueError naming its field."""
    kind = config.get("model_type")
    if kind != LLAMA:
        raise DamagedFile(
            f"{what} is not a T6 export: its {where} has model_type={kind!r}; T6 reads its own exports (model_type "
            "t6) and imports Llama-architecture models (model_type llama)"
        )
    problems = [
        f"{name}={config[name]!r} ({instead} in T6)"
        for name, refused, instead in UNSUPPORTED
        if name in config and refused(config[name])
    ]
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config['hidden_act']!r} (T6's SwiGLU gates with silu)")
    if problems:
        raise SettingError(f"{what}: T6 cannot express this model's " + "; ".join(problems))
    theta, scaling = rope_settings(config, what)
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    if kv_heads == heads:
        attention, options = "mha", {}
    elif kv_heads == 1:
        attention, options = "mqa", {}
    else:
        attention, options = "gqa", {"n_kv_head": kv_heads}
    return ModelConfig(
        vocab_size=int(config["vocab_size"]),
        block_size=int(config["max_position_embeddings"]),
        n_layer=int(config["num_hidden_layers"]),
        d_model=int(config["hidden_size"]),
        n_head=heads,
        head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
        ffn_hidden=int(config["intermediate_size"]),
        attention=attention,
        attention_options=options,
        rope_theta=theta,
        rope_remap=scaling,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def llama_state_dict(weights: dict[str, torch.Tensor], cfg: ModelConfig, what: str) -> dict[str, torch.Tensor]:
    """Hugging Face Llama weights (LlamaForCausalLM's names) -> the T6 state dict of cfg."""
    state, unknown = {}, []
    for name, tensor in weights.items():
        if name in TOP_NAMES:
            state[TOP_NAMES[name]] = tensor
            continue
        parts = name.split(".", 3)  # model, layers, i, rest
        if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in LAYER_NAMES:
            state[f"blocks.{parts[2]}.{LAYER_NAMES[parts[3]]}"] = tensor
        elif not name.endswith("rotary_emb.inv_freq"):  # old exports saved the RoPE frequencies: recomputed here
            unknown.append(name)
    if unknown:
        raise SettingError(f"{what}: weights T6 has no place for: {', '.join(sorted(unknown)[:8])}")
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["embed.weight"]  # one tensor
    return state


def read_safetensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's model.safetensors (or its shards, by the index)."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise MissingFile(
            f"{what}={str(path)!r} has config.json but no model.safetensors (T6 reads safetensors only, never pickled "
            "weights)"
        )
    weights = {}
    for name in files:
        weights.update(load_file(path / name))
    return weights


def read_pretrained(path: str | Path, what: str = "ckpt_path") -> dict:
    """A Llama directory, GGUF file or Hub id -> {model_config, state_dict, source} (the form
    t6.model.load.read_checkpoint returns for a Hugging Face directory); source.path: where its tokenizer is."""
    spec = str(path)
    path = Path(spec).expanduser()
    if not path.exists() and is_hub_id(spec):
        path, hub = download(spec, what), spec
    else:
        hub = None
    if path.is_file():
        config, weights = read_gguf(path, what)
        kind = "gguf"
        cfg = llama_model_config(config, f"{what}={spec!r}", "GGUF metadata")
    else:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        cfg = llama_model_config(config, f"{what}={spec!r}")  # refused before any weight is read
        weights = read_safetensors(path, what)
        kind = "hub" if hub else "safetensors"
    state = {k: v.float() if v.is_floating_point() else v for k, v in llama_state_dict(weights, cfg, spec).items()}
    source = {"pretrained": hub or str(path.resolve()), "path": str(path.resolve()), "format": kind}
    source["model_type"] = LLAMA
    source.update(attention=cfg.attention, n_head=cfg.n_head)
    return {
        "model_config": asdict(cfg),
        "state_dict": state,
        "source": source,
        "mlflow_run_id": None,
        "global_step": 0,
    }


def read_gguf(path: Path, what: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the config as transformers reads it, the dequantized weights under Hugging Face's names) of a GGUF
    file, through transformers' GGUF loading (the `gguf` package dequantizes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    except Exception as err:  # transformers raises ValueError/KeyError/... for what it cannot read
        raise DamagedFile(f"{what}={str(path)!r} is not a GGUF model transformers reads: {err}") from None
    llama_model_config(config, f"{what}={str(path)!r}", "GGUF metadata")  # refuse before dequantizing everything
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return config, model.state_dict()


def download(repo_id: str, what: str) -> Path:
    """A Hub model's config, safetensors and tokenizer files, into the Hugging Face cache; the network
    must allow it (HF_HUB_OFFLINE=1 reads the cache only)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"]))
    except Exception as err:  # network, authentication, unknown repository: the hub's own error types
        raise MissingFile(
            f"{what}={repo_id!r} is neither a local file or directory nor a Hub model this machine can download "
            f"({type(err).__name__}: {str(err).splitlines()[0][:200]})"
        ) from None
