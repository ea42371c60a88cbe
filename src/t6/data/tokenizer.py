"""The tokenizer: the one owner of text <-> token ids for data preparation, training, evaluation,
generation, samples and export.

A run's tokenizer is a choice (`tokenizer=` in train.yaml and prepare.yaml, `load_tokenizer`):

- `gpt2`, the default: GPT-2 BPE through tiktoken, built offline from the ranks file shipped in
  this package (`tiktoken.get_encoding("gpt2")` would download it), checked against the sha256 that
  tiktoken itself expects: 50,257 tokens, `<|endoftext|>` = 50256;
- a pretrained model's own (`pretrained_tokenizer`): the tokenizer.json of a Hugging Face directory or
  the vocabulary of a GGUF file, read offline by transformers into a `tokenizers` Tokenizer;
- the tokenizer a T6 checkpoint (or converted checkpoint, or imported model) records.

Every tokenizer says what it is as plain data (`spec`, stored in checkpoints; `from_spec` rebuilds it)
and by an id (`id`, in shard manifests and MLflow), so shards, models and runs of different
tokenizers are told apart. `eot` is the end-of-text token that separates documents in shards (GPT-2's
`<|endoftext|>`, a pretrained tokenizer's eos), `dtype` the shards' token type (uint32 when the
vocabulary exceeds 65,535).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from t6.errors import DamagedFile, MissingFile

ASSETS = Path(__file__).parent / "assets"
GPT2_RANKS = ASSETS / "gpt2.tiktoken"
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# The r50k / gpt2 pre-tokenization pattern (tiktoken_ext.openai_public.r50k_pat_str).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
EOT = 50256
GPT2 = "gpt2"
UINT16_TOKENS = 2**16  # vocabularies up to this many tokens fit uint16 shards


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
        raise DamagedFile(
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


class Tokenizer:
    """Text <-> token ids. `encode` never adds special tokens (a BOS), as lm-eval's `hf` model encodes by
    default; `encode_special` also reads special-token text (a prompt naming <|endoftext|>) as the token
    (a pretrained tokenizer always does, as transformers does; GPT-2's `encode` reads it as plain text)."""

    name: str  # what it is, for people: gpt2, or where a pretrained tokenizer was read from
    id: str  # what it is, exactly: the manifests' and MLflow's key
    eot: int  # end of text: the separator before each document in shards
    n_vocab: int  # token ids are < n_vocab

    @property
    def dtype(self) -> type[np.unsignedinteger]:
        """The token type of shards: uint16 while every id fits, else uint32."""
        return np.uint16 if self.n_vocab <= UINT16_TOKENS else np.uint32

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_special(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def spec(self) -> dict[str, Any]:
        """Plain data that `from_spec` rebuilds this tokenizer from (checkpoints: weights_only loadable)."""
        raise NotImplementedError

    def __eq__(self, other) -> bool:
        return isinstance(other, Tokenizer) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, {self.n_vocab} tokens, id {self.id})"


class GPT2Tokenizer(Tokenizer):
    name = GPT2
    id = f"gpt2-bpe:{GPT2_RANKS_SHA256[:16]}"
    eot = EOT
    n_vocab = 50257

    def __init__(self):
        self.enc = gpt2_encoding()

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts, num_threads=1)

    def encode_special(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special={"<|endoftext|>"})

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)

    def spec(self) -> dict[str, Any]:
        return {"kind": GPT2, "id": self.id}


class PretrainedTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` Tokenizer (a pretrained model's), kept as its JSON, with what transformers'
    tokenizer adds around it: the special tokens by role (`special_tokens`: bos_token, eos_token, unk_token,
    pad_token as text) and the chat template, which an export writes back (t6.hf.tokenizer_files)."""

    def __init__(
        self,
        json: str,
        name: str,
        eot: int,
        bos: int | None = None,
        special_tokens: dict[str, str] | None = None,
        chat_template: str | None = None,
    ):
        from tokenizers import Tokenizer as Backend

        self.backend = Backend.from_str(json)
        self.json = self.backend.to_str()  # one form, so equal tokenizers have equal ids
        self.name, self.eot, self.bos = name, int(eot), bos
        self.special_tokens, self.chat_template = dict(special_tokens or {}), chat_template
        self.n_vocab = max(self.backend.get_vocab(with_added_tokens=True).values()) + 1  # ids may have gaps
        self.id = f"hf-tokenizer:{hashlib.sha256(self.json.encode()).hexdigest()[:16]}"

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def encode_special(self, text: str) -> list[int]:
        return self.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)

    def spec(self) -> dict[str, Any]:
        return {
            "kind": "tokenizers",
            "id": self.id,
            "name": self.name,
            "json": self.json,
            "eot": self.eot,
            "bos": self.bos,
            "special_tokens": self.special_tokens,
            "chat_template": self.chat_template,
        }


@functools.cache
def gpt2() -> GPT2Tokenizer:
    return GPT2Tokenizer()


def from_spec(spec: dict[str, Any] | None) -> Tokenizer:
    """The tokenizer a checkpoint records (`Tokenizer.spec`); None (checkpoints from before tokenizers were
    recorded, all GPT-2) is GPT-2."""
    if spec is None or spec.get("kind") == GPT2:
        return gpt2()
    if spec.get("kind") == "tokenizers":
        special = tuple(sorted((spec.get("special_tokens") or {}).items()))  # checkpoints before it: none
        template = spec.get("chat_template")
        return _from_json(spec["json"], spec["name"], int(spec["eot"]), spec.get("bos"), special, template)
    raise DamagedFile(f"unknown tokenizer kind {spec.get('kind')!r} in a checkpoint (known: gpt2, tokenizers)")


@functools.lru_cache(maxsize=8)
def _from_json(
    json: str, name: str, eot: int, bos: int | None, special: tuple = (), chat_template: str | None = None
) -> PretrainedTokenizer:
    return PretrainedTokenizer(json, name, eot, bos, dict(special), chat_template)


def exported_tokenizer(directory: str | Path, record: dict[str, Any]) -> Tokenizer:
    """The tokenizer of a T6 export (t6.hf.export): what its config.json records (`Tokenizer.spec` without the
    JSON), with the directory's tokenizer.json; GPT-2 where it records GPT-2."""
    if record.get("kind") != "tokenizers":
        return from_spec(record)
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise MissingFile(
            f"{directory}: config.json records the tokenizer {record.get('name')} but the directory has no {path.name}"
        )
    return from_spec({**record, "json": path.read_text(encoding="utf-8")})


def checkpoint_tokenizer(ckpt: dict) -> Tokenizer:
    """The tokenizer of a read checkpoint (t6.model.load.read_checkpoint): the one it records; a pretrained
    model's own, read from where it came from (t6.model.pretrained); else GPT-2 (every checkpoint from before
    tokenizers were recorded)."""
    source = ckpt.get("source") or {}
    from t6.model.load import HF_FORMAT

    if ckpt.get("format") == HF_FORMAT and source.get("hf_dir"):  # a T6 export: what its config.json records
        return exported_tokenizer(source["hf_dir"], ckpt.get("tokenizer") or {"kind": GPT2})
    if ckpt.get("tokenizer") is None and source.get("model_type") and source.get("path"):
        tokenizer = pretrained_tokenizer(source["path"])
        if tokenizer is None:
            raise MissingFile(
                f"{source['path']} has no tokenizer (tokenizer.json); put the model's tokenizer files beside it"
            )
        return tokenizer
    return from_spec(ckpt.get("tokenizer"))


def load_with_tokenizer(path, *, what: str = "ckpt_path", device="cpu"):
    """(the T6, its tokenizer: `checkpoint_tokenizer`) of anything t6.model.load.load_model reads, read once."""
    from t6.model.load import build_model, read_checkpoint

    ckpt = read_checkpoint(path, what, map_location="cpu", mmap=True)
    return build_model(ckpt, what, path, device), checkpoint_tokenizer(ckpt)


def pretrained_tokenizer(path: str | Path) -> PretrainedTokenizer | None:
    """A pretrained model's own tokenizer, read offline by transformers: from a Hugging Face directory
    (tokenizer.json and its config) or a GGUF file (its vocabulary); None when the directory has none."""
    from transformers import AutoTokenizer

    path = Path(path)
    try:
        if path.is_file():
            hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        elif (path / "tokenizer.json").is_file():
            hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        else:
            return None
    except Exception as err:  # transformers raises many kinds for a tokenizer it cannot read
        raise DamagedFile(f"the tokenizer of {path} is not readable by transformers: {err}") from None
    if not getattr(hf, "is_fast", False):
        raise DamagedFile(f"the tokenizer of {path} has no fast (tokenizers) form; T6 Lab reads tokenizer.json")
    eot = hf.eos_token_id if hf.eos_token_id is not None else hf.bos_token_id
    if eot is None:
        raise DamagedFile(f"the tokenizer of {path} names no end-of-text (eos) token to separate documents with")
    special = tuple(sorted((k, v) for k, v in hf.special_tokens_map.items() if isinstance(v, str)))
    return _from_json(hf.backend_tokenizer.to_str(), str(path), int(eot), hf.bos_token_id, special, hf.chat_template)


def load_tokenizer(setting: str | Path | None) -> Tokenizer:
    """A run's `tokenizer=` setting: `gpt2` (or null), a pretrained model's directory or GGUF file, or a T6
    checkpoint (training, converted, exported) whose recorded tokenizer it is. Errors name the setting."""
    if setting is None or str(setting) == GPT2:
        return gpt2()
    return _load_path(str(Path(str(setting)).expanduser().resolve()), _mtime(setting))


def run_tokenizer(setting: str | Path | None, init_from: str | Path | None = None) -> Tokenizer:
    """A training run's tokenizer: `tokenizer=` (`load_tokenizer`); null is init_from's own (the tokenizer its
    checkpoint records or its pretrained model has), else GPT-2."""
    if setting is None and init_from:
        return load_tokenizer(init_from)
    return load_tokenizer(setting)


def _mtime(setting) -> float:
    path = Path(str(setting)).expanduser()
    if not path.exists():
        raise MissingFile(
            f"tokenizer={setting!r} is neither `gpt2` nor an existing path (a Hugging Face directory, a GGUF file, "
            "or a checkpoint that records its tokenizer)"
        )
    return path.stat().st_mtime


@functools.lru_cache(maxsize=8)
def _load_path(path: str, mtime: float) -> Tokenizer:
    """The tokenizer at path, once per file version (the plan, the data and the evaluation all ask)."""
    from t6.model.load import read_checkpoint
    from t6.model.pretrained import is_pretrained

    p = Path(path)
    if is_pretrained(p):
        tokenizer = pretrained_tokenizer(p)
        if tokenizer is None:
            raise MissingFile(f"tokenizer={path!r}: the directory has no tokenizer.json")
        return tokenizer
    if p.is_dir() and (p / "tokenizer.json").is_file() and not (p / "config.json").is_file():
        return pretrained_tokenizer(p)
    return checkpoint_tokenizer(read_checkpoint(p, "tokenizer", mmap=True))


def mismatch(what: str, have: Tokenizer, whose: str, want: Tokenizer) -> str:
    """The message for two tokenizers that must agree: names both and the fix."""
    return (
        f"{what} uses tokenizer {have.name} ({have.id}, {have.n_vocab} tokens) but {whose} uses tokenizer "
        f"{want.name} ({want.id}, {want.n_vocab} tokens): token ids of one mean other text in the other; "
        "use one tokenizer for both (set tokenizer=, or prepare the data again with it)"
    )
