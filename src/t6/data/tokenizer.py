"""GPT-2 BPE through tiktoken, built offline from the ranks file shipped in this package.

`tiktoken.get_encoding("gpt2")` downloads its files on first use; this builds the same
encoding (50,257 tokens, `<|endoftext|>` = 50256) from `assets/gpt2.tiktoken`, checked
against the sha256 that tiktoken itself expects.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

ASSETS = Path(__file__).parent / "assets"
GPT2_RANKS = ASSETS / "gpt2.tiktoken"
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# The r50k / gpt2 pre-tokenization pattern (tiktoken_ext.openai_public.r50k_pat_str).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
EOT = 50256


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@functools.cache
def gpt2_encoding() -> tiktoken.Encoding:
    actual = sha256_file(GPT2_RANKS)
    if actual != GPT2_RANKS_SHA256:
        raise RuntimeError(
            f"{GPT2_RANKS} has sha256 {actual}, expected {GPT2_RANKS_SHA256}; reinstall the package to restore it"
        )
    ranks = load_tiktoken_bpe(str(GPT2_RANKS), expected_hash=GPT2_RANKS_SHA256)
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
        explicit_n_vocab=50257,
    )


def tokenizer_id() -> str:
    """Identifies the tokenizer in shard manifests, so shards from another tokenizer are rejected."""
    return f"gpt2-bpe:{GPT2_RANKS_SHA256[:16]}"
