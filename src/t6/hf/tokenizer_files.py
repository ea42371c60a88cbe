"""The Hugging Face tokenizer of an export: the model's own (t6.data.tokenizer.checkpoint_tokenizer), so
`AutoTokenizer.from_pretrained(DIR)` encodes as the model was trained and evaluated.

- GPT-2 (the default): the BPE of t6.data.tokenizer, built from the same shipped ranks file by transformers'
  tiktoken converter with the same split pattern and `<|endoftext|>` as bos, eos, unk and pad;
- a pretrained model's (imported, or converted from one): its tokenizer.json as it was read, with its special
  tokens (bos, eos, unk, pad) and chat template; one without a pad token pads with its end of text, as GPT-2's
  export does (batches of a pipeline or lm-eval pad).

`write_tokenizer` returns the transformers tokenizer it wrote, whose token ids config.json and
generation_config.json record."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

from t6.data.tokenizer import EOT, GPT2_PATTERN, GPT2_RANKS, PretrainedTokenizer, Tokenizer, gpt2_encoding

EOT_TEXT = "<|endoftext|>"
ROLES = ("bos_token", "eos_token", "unk_token", "pad_token")


@functools.cache
def gpt2_backend():
    """The GPT-2 BPE as a `tokenizers` Tokenizer (the conversion reads 50k ranks: done once per process)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    gpt2_encoding()  # checks the ranks file's sha256
    return TikTokenConverter(
        vocab_file=str(GPT2_RANKS), pattern=GPT2_PATTERN, extra_special_tokens=[EOT_TEXT]
    ).converted()


def hf_tokenizer(model_max_length: int, tokenizer: Tokenizer | None = None):
    """A transformers fast tokenizer that encodes as `tokenizer` (None: GPT-2) does; model_max_length: the
    model's block size."""
    from transformers import PreTrainedTokenizerFast

    if isinstance(tokenizer, PretrainedTokenizer):
        from tokenizers import Tokenizer as Backend

        return PreTrainedTokenizerFast(
            tokenizer_object=Backend.from_str(tokenizer.json),
            **special_tokens(tokenizer),
            chat_template=tokenizer.chat_template,
            model_max_length=model_max_length,
        )
    return gpt2_hf_tokenizer(model_max_length)


@functools.cache
def gpt2_hf_tokenizer(model_max_length: int):
    """GPT-2's BPE as a transformers fast tokenizer (made once per process and length: each takes about a second)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=copy.deepcopy(gpt2_backend()),
        bos_token=EOT_TEXT,
        eos_token=EOT_TEXT,
        unk_token=EOT_TEXT,
        pad_token=EOT_TEXT,  # the config's pad_token_id: batches (a pipeline's, lm-eval's) pad with it
        model_max_length=model_max_length,
    )
    if hf.eos_token_id != EOT:
        raise RuntimeError(f"{EOT_TEXT} became token {hf.eos_token_id}, expected {EOT}")
    return hf


def special_tokens(tokenizer: PretrainedTokenizer) -> dict[str, str]:
    """A pretrained tokenizer's special tokens by role: those transformers read with it, else its bos and its end
    of text (eos) by id; the pad token is the eos where it has none."""
    backend, recorded = tokenizer.backend, tokenizer.special_tokens
    roles = {role: recorded[role] for role in ROLES if recorded.get(role)}
    roles.setdefault("eos_token", backend.id_to_token(tokenizer.eot))
    if tokenizer.bos is not None:
        roles.setdefault("bos_token", backend.id_to_token(tokenizer.bos))
    roles.setdefault("pad_token", roles["eos_token"])
    return roles


def write_tokenizer(out: Path, model_max_length: int, tokenizer: Tokenizer | None = None):
    """tokenizer.json and tokenizer_config.json of `tokenizer` (None: GPT-2) into out; returns the transformers
    tokenizer written. The config names PreTrainedTokenizerFast, the class every transformers release reads a
    tokenizer.json with."""
    hf = hf_tokenizer(model_max_length, tokenizer)
    hf.save_pretrained(out)
    path = Path(out) / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return hf
