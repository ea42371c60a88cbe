"""A T6 checkpoint as a Hugging Face model directory: `write_export(ckpt_path, out)`.

The directory holds everything the standard tools need, and nothing from this project:

    model.safetensors          the T6's weights under `model.` (the tied LM head stored once)
    config.json                model_type t6, ModelConfig's fields (the mechanism, its options), token
                               ids, auto_map to the two code files, and where the weights came from
    modeling_t6.py, configuration_t6.py   T6ForCausalLM and T6Config (t6.hf.modeling, t6.hf.configuration)
    t6.py, attention_tpa.py, ...          the model's own modules they import (copied: t6.hf.source)
    tokenizer.json, tokenizer_config.json   the model's tokenizer: GPT-2's BPE, or a pretrained model's own with its
                               special tokens and chat template (t6.hf.tokenizer_files)
    generation_config.json     token ids, greedy by default, at most block_size tokens
    README.md                  a model card: the model, its cost, the run's metrics from MLflow

`check_export` loads the directory with transformers (remote code) and compares its logits with the
T6's; export.py runs it after writing. The checkpoint is read by t6.model.load (a training or
weights-only Lightning checkpoint, a warm-start file, or another export), so what is not a T6 fails
there, naming the file.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from datetime import date
from pathlib import Path
from typing import Any

import torch

from t6.data.tokenizer import GPT2Tokenizer, Tokenizer, checkpoint_tokenizer, load_tokenizer
from t6.errors import SettingError
from t6.hf.source import export_sources
from t6.hf.tokenizer_files import write_tokenizer
from t6.model.config import ModelConfig
from t6.model.facts import kv_elements_per_token, meta_model, parameter_count
from t6.model.load import (
    HF_CONFIG,
    HF_MODEL_TYPE,
    HF_PREFIX,
    HF_SOURCE,
    HF_TOKENIZER,
    HF_WEIGHTS,
    HF_WEIGHTS_INDEX,
    model_state,
    read_checkpoint,
)
from t6.model.t6 import T6

log = logging.getLogger(__name__)

ARCHITECTURE = "T6ForCausalLM"
AUTO_MAP = {"AutoConfig": "configuration_t6.T6Config", "AutoModelForCausalLM": "modeling_t6.T6ForCausalLM"}
CHECK_TOLERANCE = 1e-5  # fp32 logits, transformers' T6ForCausalLM against the T6


def export_weights(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The T6 state dict under T6ForCausalLM's names; a tied LM head is the embedding, stored once."""
    return {
        HF_PREFIX + name: tensor.detach().contiguous().clone()
        for name, tensor in state.items()
        if not (cfg.tie_embeddings and name == "lm_head.weight")
    }


def hf_config(cfg: ModelConfig, dtype: torch.dtype, source: dict[str, Any], ids: dict[str, int], tokenizer: Tokenizer):
    """config.json's content as a T6Config: every ModelConfig field, the token ids (ids: the written tokenizer's),
    auto_map, the source and the tokenizer's record (its spec without the JSON, which is tokenizer.json)."""
    from t6.hf.configuration import T6Config

    record = {k: v for k, v in tokenizer.spec().items() if k != "json"}
    return T6Config(
        **asdict(cfg),
        architectures=[ARCHITECTURE],
        auto_map=AUTO_MAP,
        **ids,
        dtype=str(dtype).removeprefix("torch."),
        **{HF_SOURCE: source, HF_TOKENIZER: record},
    )


def token_ids(hf_tokenizer) -> dict[str, int]:
    """bos_token_id, eos_token_id and pad_token_id of a transformers tokenizer (those it has)."""
    ids = {f"{role}_token_id": getattr(hf_tokenizer, f"{role}_token_id") for role in ("bos", "eos", "pad")}
    return {k: v for k, v in ids.items() if v is not None}


def tokenizer_line(tokenizer: Tokenizer, vocab_size: int) -> str:
    """The model card's sentence on the tokenizer."""
    what = "GPT-2 BPE" if isinstance(tokenizer, GPT2Tokenizer) else f"the pretrained model's own (`{tokenizer.name}`)"
    return (
        f"Tokenizer: {what}, {tokenizer.n_vocab:,} tokens (end of text: {tokenizer.eot}; the embedding has "
        f"{vocab_size} rows)."
    )


def provenance(ckpt: dict) -> dict[str, Any]:
    """Where the weights came from: the MLflow run, optimizer steps and training tokens the checkpoint records."""
    if "source" in ckpt:  # a warm-start checkpoint or an export: its own record
        keep = ("mlflow_run_id", "steps", "samples", "seq_len", "tokens", "pretrained")
        return {k: ckpt["source"].get(k) for k in keep if ckpt["source"].get(k) is not None}
    from t6.uptrain.convert import source_tokens

    return {"mlflow_run_id": ckpt.get("mlflow_run_id"), **source_tokens(ckpt)}


def run_record(run_id: str | None, tracking_uri: str | None) -> tuple[dict[str, float], str]:
    """(the run's latest metrics, a line saying where they come from), read from MLflow when the run
    is in the store; an absent store or run gives no metrics and says why (nothing is created)."""
    if not run_id:
        return {}, "The checkpoint records no MLflow run."
    if not tracking_uri:
        return {}, f"MLflow run `{run_id}` (no tracking store given)."
    if tracking_uri.startswith("sqlite:///") and not Path(tracking_uri.removeprefix("sqlite:///")).is_file():
        return {}, f"MLflow run `{run_id}` (not in this machine's store)."
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        run = MlflowClient(tracking_uri=tracking_uri).get_run(run_id)
    except MlflowException as err:
        log.warning("export: MLflow run %s not read from %s: %s", run_id, tracking_uri, err)
        return {}, f"MLflow run `{run_id}` (not in the store {tracking_uri})."
    return dict(run.data.metrics), f"MLflow run `{run_id}` ({run.info.run_name}), metrics at the end of the run."


def metrics_table(metrics: dict[str, float]) -> str:
    """Validation loss and the downstream evaluations (eval/{n}shot/{task}/{metric}) as markdown."""
    from t6.report.evals import eval_metrics

    rows = [f"| validation | {k.split('/')[1]} | {metrics[k]:.4f} |" for k in ("val/loss", "val/ppl") if k in metrics]
    for shots, tasks in sorted(eval_metrics(metrics).items()):
        for task, values in sorted(tasks.items()):
            rows += [
                f"| {task}, {shots}-shot | {m} | {v:.4f} |" for m, v in sorted(values.items()) if "stderr" not in m
            ]
        if f"eval/{shots}shot/avg" in metrics:
            rows.append(f"| average, {shots}-shot | avg | {metrics[f'eval/{shots}shot/avg']:.4f} |")
    if not rows:
        return "No metrics recorded."
    return "| what | metric | value |\n|---|---|---|\n" + "\n".join(rows)


def model_card(
    cfg: ModelConfig, source: dict[str, Any], metrics: dict[str, float], origin: str, tokenizer: Tokenizer
) -> str:
    """README.md: what the model is, what it costs, how it was trained and evaluated, how to use it."""
    model = meta_model(cfg)
    options = ", ".join(f"{k}={v}" for k, v in cfg.attention_options.items()) or "none"
    steps, tokens = source.get("steps"), source.get("tokens")
    trained = (
        "Trained with T6 Lab"
        + (f": {steps} optimizer steps" if steps else "")
        + (f", {tokens:,} tokens" if tokens else "")
        + (f", from the pretrained `{source['pretrained']}`" if source.get("pretrained") else "")
    )
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [t6, tensor-product-attention, {cfg.attention}]
---

# T6 ({cfg.attention})

A decoder-only language model of the T6 family (Tensor Product Attention Is All You Need,
arXiv 2501.06425): LLaMA-style blocks (RMSNorm, SwiGLU, RoPE, tied embedding) whose attention is
`{cfg.attention}` (options: {options}). {trained}. {tokenizer_line(tokenizer, cfg.vocab_size)}

| | |
|---|---|
| parameters | {parameter_count(model):,} ({parameter_count(model, non_embedding=True):,} without the embedding) |
| layers x width | {cfg.n_layer} x {cfg.d_model}, {cfg.n_head} query heads of {cfg.head_dim} |
| context | {cfg.block_size} tokens |
| KV cache per token and layer | {kv_elements_per_token(model):,} numbers |

## Metrics

{origin}

{metrics_table(metrics)}

## Use

The model's code ships with it (`modeling_t6.py`), so load it with `trust_remote_code=True`:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)
ids = tokenizer("ROMEO:", return_tensors="pt").input_ids
print(tokenizer.decode(model.generate(ids, max_new_tokens=40)[0]))
```

Evaluate it with lm-evaluation-harness:
`lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True,logits_cache=False --tasks ...`
(lm-eval 0.4.13's `logits_cache` misreads some continuations when tasks share text).
T6 Lab reads the directory back: `python eval.py ckpt_path=DIR`, `python generate.py ckpt_path=DIR`,
`python train.py init_from=DIR` (fine-tuning).

Exported on {date.today().isoformat()}.
"""


def write_export(
    ckpt_path: str | Path, out: str | Path, tracking_uri: str | None = None, what: str = "ckpt_path"
) -> tuple[T6, Path]:
    """Write the Hugging Face directory of the checkpoint into out; returns (the T6 it holds, out)."""
    path = Path(ckpt_path).expanduser()
    ckpt = read_checkpoint(path, what, mmap=True)
    cfg, state = model_state(ckpt, what, path)
    tokenizer = checkpoint_tokenizer(ckpt)  # the model's own: GPT-2, or a pretrained model's
    code = export_sources()  # every registered mechanism; one that cannot be carried is an error naming it
    model = T6(cfg)
    model.load_state_dict(state)
    model.eval()
    out = Path(out).expanduser()
    if out.resolve() == path.resolve():
        raise SettingError(f"out={str(out)!r} is the checkpoint being exported; choose another directory")
    out.mkdir(parents=True, exist_ok=True)
    for stale in [out / HF_WEIGHTS_INDEX, *out.glob("model-*-of-*.safetensors")]:  # a sharded save in the way
        stale.unlink(missing_ok=True)

    from safetensors.torch import save_file
    from transformers import GenerationConfig

    source = provenance(ckpt)
    save_file(export_weights(model.state_dict(), cfg), out / HF_WEIGHTS, metadata={"format": "pt"})
    ids = token_ids(write_tokenizer(out, cfg.block_size, tokenizer))
    config = hf_config(cfg, model.embed.weight.dtype, source, ids, tokenizer)
    config.save_pretrained(out)
    if json.loads((out / HF_CONFIG).read_text())["model_type"] != HF_MODEL_TYPE:
        raise RuntimeError(f"{out / HF_CONFIG} was written without model_type {HF_MODEL_TYPE!r}")
    for name, text in code.items():
        (out / name).write_text(text, encoding="utf-8")
    GenerationConfig(**ids, do_sample=False).save_pretrained(out)
    metrics, origin = run_record(source.get("mlflow_run_id"), tracking_uri)
    (out / "README.md").write_text(model_card(cfg, source, metrics, origin, tokenizer), encoding="utf-8")
    return model, out


def check_export(out: str | Path, model: T6, tokens: torch.Tensor) -> float:
    """Load out with transformers (its own code, offline) and return the largest difference between its
    logits and the T6's on tokens [B, T]; more than CHECK_TOLERANCE is an error."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.float()(tokens)  # [B, T, V]
        got = hf(tokens).logits  # [B, T, V]
    diff = float((got - want).abs().max())
    if not diff <= CHECK_TOLERANCE:
        raise RuntimeError(
            f"{out}: transformers' T6ForCausalLM gives logits {diff:.3g} away from the T6's (more than "
            f"{CHECK_TOLERANCE}); the export is not faithful"
        )
    return diff


def sample_tokens(cfg: ModelConfig, tokenizer: Tokenizer | None = None, n: int = 64) -> torch.Tensor:
    """The first min(n, block_size) tokens of the shipped corpus in the model's tokenizer (None: GPT-2) [1, T],
    for check_export."""
    from t6.data.corpus import TINY_SHAKESPEARE
    from t6.data.tokenizer import gpt2

    text = TINY_SHAKESPEARE.read_text(encoding="utf-8")[: 8 * n]
    tokens = (tokenizer or gpt2()).encode(text)[: min(n, cfg.block_size)]
    return torch.tensor([tokens]) % cfg.vocab_size  # [1, T]


def check_request(cfg) -> None:
    """Before anything is written: ckpt_path and out given, the checkpoint a T6 that reads whole, out a directory
    (or not there yet), not the checkpoint itself."""
    from omegaconf import OmegaConf

    for name in ("ckpt_path", "out"):
        if OmegaConf.is_missing(cfg, name) or not cfg.get(name):
            raise SettingError(f"{name} is required: python export.py ckpt_path=PATH/last.ckpt out=DIR")
    path, out = Path(cfg.ckpt_path).expanduser(), Path(cfg.out).expanduser()
    model_state(read_checkpoint(path, "ckpt_path", mmap=True), "ckpt_path", path)
    if out.exists() and not out.is_dir():
        raise SettingError(f"out={str(out)!r} is a file; give a directory to write the export into (it is created)")
    if out.resolve() == path.resolve():
        raise SettingError(f"out={str(out)!r} is the checkpoint being exported; choose another directory")


def run(cfg) -> list[str]:
    """`python export.py` (conf/export.yaml): write the directory and check it (unless check=false);
    returns the lines to print."""
    from omegaconf import OmegaConf

    for name in ("ckpt_path", "out"):
        if OmegaConf.is_missing(cfg, name) or not cfg.get(name):
            raise SettingError(f"{name} is required: python export.py ckpt_path=PATH/last.ckpt out=DIR")
    model, out = write_export(cfg.ckpt_path, cfg.out, cfg.get("tracking_uri"))
    lines = [f"wrote {out}: T6 ({model.cfg.attention}), {len(list(out.iterdir()))} files"]
    tokenizer = load_tokenizer(out)  # as the project reads the directory back
    if cfg.get("check", True):
        diff = check_export(out, model, sample_tokens(model.cfg, tokenizer))
        lines.append(f"checked: transformers' logits are the T6's to {diff:.1e} (AutoModelForCausalLM, remote code)")
    lines.append(f"tokenizer: {tokenizer.name} ({tokenizer.n_vocab:,} tokens, {tokenizer.id})")
    lines.append(f"load it with AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)")
    return lines


def main(cfg) -> None:
    """export.py: check the request (conf/export.yaml), write the export and print where it is and how to load it."""
    check_request(cfg)
    for line in run(cfg):
        print(line)
