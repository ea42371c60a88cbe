"""The Hugging Face tokenizer of an export: the GPT-2 BPE of t6.data.tokenizer, built from the same
shipped ranks file by transformers' tiktoken converter with the same split pattern and
`<|endoftext|>`, so `AutoTokenizer.from_pretrained(DIR)` encodes as `gpt2_encoding()` does."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

from t6.data.tokenizer import EOT, GPT2_PATTERN, GPT2_RANKS, gpt2_encoding

EOT_TEXT = "<|endoftext|>"


@functools.cache
def gpt2_backend():
    """The GPT-2 BPE as a `tokenizers` Tokenizer (the conversion reads 50k ranks: done once per process)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    gpt2_encoding()  # checks the ranks file's sha256
    return TikTokenConverter(
        vocab_file=str(GPT2_RANKS), pattern=GPT2_PATTERN, extra_special_tokens=[EOT_TEXT]
    ).converted()


def hf_tokenizer(model_max_length: int):
    """A transformers fast tokenizer equal to gpt2_encoding(); model_max_length: the model's block size."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=copy.deepcopy(gpt2_backend()),
        bos_token=EOT_TEXT,
        eos_token=EOT_TEXT,
        unk_token=EOT_TEXT,
        pad_token=EOT_TEXT,  # the config's pad_token_id: batches (a pipeline's, lm-eval's) pad with it
        model_max_length=model_max_length,
    )
    if tokenizer.eos_token_id != EOT:
        raise RuntimeError(f"{EOT_TEXT} became token {tokenizer.eos_token_id}, expected {EOT}")
    return tokenizer


def write_tokenizer(out: Path, model_max_length: int) -> None:
    """tokenizer.json and tokenizer_config.json into out. The config names PreTrainedTokenizerFast, the
    class every transformers release reads a tokenizer.json with."""
    hf_tokenizer(model_max_length).save_pretrained(out)
    path = Path(out) / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
