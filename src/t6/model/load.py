"""Reading checkpoints into a T6: the one loader every script calls.

Four things hold a T6: a Lightning training checkpoint (`hyper_parameters.model_config`,
`state_dict` with `model.` keys) written by train.py, a converted warm-start checkpoint
(`format`, `model_config`, `state_dict`) written by convert.py, and a Hugging Face directory
written by export.py (or saved again by transformers): `config.json` with `model_type: t6` and
ModelConfig's fields, the weights in safetensors under the same `model.` keys; and a pretrained
Llama-architecture model, as a Hugging Face directory, a GGUF file or a Hub id (t6.model.pretrained),
read as a T6 with grouped-query attention. Each carries or names its tokenizer (read by
t6.data.tokenizer.checkpoint_tokenizer). Files are read with
`torch.load(weights_only=True)`, directories with safetensors: pickled code is never run. Every
problem (missing, damaged, not a T6, weights that do not fit the config) is an error naming the
config field, the file and the fix.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch

from t6.errors import DamagedFile, MissingFile
from t6.model.config import ModelConfig
from t6.model.t6 import T6

WARM_START_FORMAT = "t6-warm-start-v1"
# A Hugging Face directory, as read_checkpoint returns it: a warm-start checkpoint's keys (`model_config`,
# `state_dict`, `source`), so init_from= takes one as it takes a converted checkpoint.
HF_FORMAT = "t6-hugging-face"
HF_MODEL_TYPE = "t6"
HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"  # transformers' sharded weights
HF_PREFIX = "model."  # T6ForCausalLM holds its T6 as `model`, as the Lightning module does
HF_SOURCE = "t6_source"  # config.json: where the exported weights came from (MLflow run, steps, tokens)
HF_TOKENIZER = "t6_tokenizer"  # config.json: the tokenizer's record (t6.data.tokenizer's spec without its JSON)


def read_checkpoint(path, what: str = "ckpt_path", map_location: Any = "cpu", mmap: bool = False) -> dict:
    """torch.load(weights_only=True) of a checkpoint named by the config field `what`, or a Hugging Face
    directory (`read_hf_directory`); a missing, truncated or corrupted file is an error naming the field,
    the file and the fix. A pretrained Llama (directory, GGUF file, Hub id) is read by t6.model.pretrained."""
    from t6.model.pretrained import is_hub_id, is_pretrained, read_pretrained

    spec, path = str(path), Path(path).expanduser()
    if is_pretrained(path) or (not path.exists() and is_hub_id(spec)):
        return {"format": HF_FORMAT, **read_pretrained(spec, what)}
    if path.is_dir():
        return read_hf_directory(path, what)
    if not path.is_file():
        raise MissingFile(
            f"{what}={str(path)!r} does not exist (e.g. logs/train/runs/<time>/checkpoints/last.ckpt, a "
            "directory written by export.py, a Llama's Hugging Face directory or GGUF file)"
        )
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as err:  # torch/zipfile/unpickler errors of a damaged file have no common type
        if "weights_only" in str(err) and "Unsupported global" in str(err):
            raise pickle.UnpicklingError(
                f"{what}={str(path)!r} holds pickled code, which T6 Lab never loads: {err}"
            ) from None
        raise DamagedFile(
            f"{what}={str(path)!r} is not a readable checkpoint (truncated or corrupted? {type(err).__name__}: "
            f"{str(err).splitlines()[0][:200]}); point {what} at an intact file, e.g. an earlier step*.ckpt "
            "of the same run"
        ) from None
    if not isinstance(ckpt, dict):
        raise DamagedFile(
            f"{what}={str(path)!r} is not a T6 Lab checkpoint (it holds a {type(ckpt).__name__}, not a dict)"
        )
    return ckpt


def read_hf_directory(path: Path, what: str = "ckpt_path") -> dict:
    """A Hugging Face directory of a T6 -> {format: HF_FORMAT, model_config, state_dict, source, tokenizer}: the
    ModelConfig fields of config.json (checked), the T6 state dict from safetensors (the tied LM head
    filled in from the embedding), the provenance export.py recorded and its tokenizer's record (None before
    exports recorded one: GPT-2; read with the directory's tokenizer.json by t6.data.tokenizer)."""
    from safetensors.torch import load_file

    config_file = path / HF_CONFIG
    if not config_file.is_file():
        raise MissingFile(
            f"{what}={str(path)!r} is a directory without {HF_CONFIG}; point {what} at a checkpoint file or at a "
            "directory written by export.py"
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DamagedFile(f"{what}={str(path)!r}: {HF_CONFIG} is not readable JSON ({err})") from None
    if not isinstance(config, dict) or config.get("model_type") != HF_MODEL_TYPE:
        kind = config.get("model_type") if isinstance(config, dict) else type(config).__name__
        raise DamagedFile(
            f"{what}={str(path)!r} is not a T6 export: its {HF_CONFIG} has model_type={kind!r}, not "
            f"{HF_MODEL_TYPE!r} (T6 Lab reads the directories export.py writes)"
        )
    try:
        cfg = ModelConfig(**{f.name: config[f.name] for f in fields(ModelConfig) if f.name in config})
    except (TypeError, ValueError) as err:
        raise DamagedFile(f"{what}={str(path)!r}: its {HF_CONFIG} does not build a T6 here: {err}") from None
    index = path / HF_WEIGHTS_INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    elif (path / HF_WEIGHTS).is_file():
        files = [HF_WEIGHTS]
    else:
        raise MissingFile(f"{what}={str(path)!r} has {HF_CONFIG} but no {HF_WEIGHTS} (nor {HF_WEIGHTS_INDEX})")
    weights = {}
    for name in files:
        try:
            weights.update(load_file(path / name))
        except Exception as err:  # safetensors raises its own error types for a damaged file
            raise DamagedFile(
                f"{what}={str(path)!r}: {name} is not readable safetensors ({type(err).__name__}: {err})"
            ) from None
    state = {k.removeprefix(HF_PREFIX): v for k, v in weights.items() if k.startswith(HF_PREFIX)}
    if cfg.tie_embeddings and "lm_head.weight" not in state and "embed.weight" in state:
        state["lm_head.weight"] = state["embed.weight"]  # one tensor, stored once
    source = dict(config.get(HF_SOURCE) or {})
    source.update(hf_dir=str(path.resolve()), attention=cfg.attention, n_head=cfg.n_head)
    return {
        "format": HF_FORMAT,
        "model_config": asdict(cfg),
        "state_dict": state,
        "source": source,
        "mlflow_run_id": source.get("mlflow_run_id"),
        "global_step": source.get("steps") or 0,
        "tokenizer": config.get(HF_TOKENIZER),
    }


def model_state(ckpt: dict, what: str, path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(model config, backbone state dict) of a training or warm-start checkpoint or a Hugging Face directory."""
    try:
        if ckpt.get("format") in (WARM_START_FORMAT, HF_FORMAT):
            fields, state = ckpt["model_config"], ckpt["state_dict"]
        else:
            fields = ckpt["hyper_parameters"]["model_config"]
            state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    except (KeyError, TypeError, AttributeError) as err:
        raise DamagedFile(
            f"{what}={str(path)!r} is not a T6 checkpoint: it has no {err} "
            "(train.py writes checkpoints/last.ckpt, convert.py a warm-start file)"
        ) from None
    try:
        cfg = ModelConfig(**fields)
    except (TypeError, ValueError) as err:
        raise DamagedFile(f"{what}={str(path)!r}: its model config does not build a T6 here: {err}") from None
    check_weights(state, cfg, f"{what}={path}")
    return cfg, state


def check_weights(state: dict[str, torch.Tensor], cfg: ModelConfig, what: str) -> None:
    """Raise naming every missing, unexpected or mis-shaped tensor when state does not fit cfg."""
    with torch.device("meta"):  # shapes only, no memory
        expected = {k: tuple(v.shape) for k, v in T6(cfg).state_dict().items()}
    problems = [f"missing {k}" for k in expected if k not in state]
    problems += [f"unexpected {k}" for k in state if k not in expected]
    problems += [
        f"{k}: shape {tuple(state[k].shape)}, config says {shape}"
        for k, shape in expected.items()
        if k in state and tuple(state[k].shape) != shape
    ]
    if problems:
        shown = problems[:8] + ([f"... {len(problems) - 8} more"] if len(problems) > 8 else [])
        raise DamagedFile(
            f"{what}: the weights do not match its model config ({cfg.attention}, n_head={cfg.n_head}, "
            f"d_model={cfg.d_model}, n_layer={cfg.n_layer}):\n  - " + "\n  - ".join(shown)
        )


def build_model(ckpt: dict, what: str, path, device: str | torch.device = "cpu") -> T6:
    """The T6 of an already read checkpoint (training, warm-start or Hugging Face), on `device`, in eval mode."""
    cfg, state = model_state(ckpt, what, path)
    model = T6(cfg)
    model.load_state_dict(state)
    return model.to(device).eval()


def load_model(path, *, what: str = "ckpt_path", device: str | torch.device = "cpu") -> T6:
    """The T6 held by a training or warm-start checkpoint or a Hugging Face directory, on `device`, in eval mode."""
    return build_model(read_checkpoint(path, what, map_location="cpu", mmap=True), what, path, device)
