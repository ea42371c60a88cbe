"""Turn a plain-text corpus into token shards (the embedded default: Tiny Shakespeare).

The shards are a cache: they are rebuilt when the text or the tokenizer changes (both
are recorded in the manifest) and reused otherwise. Where the corpus splits into training and
validation text is one rule for every tokenizer (`split_text`: GPT-2's last tenth of the tokens), so
the local evaluation tasks, built from the validation text, hold no training text whatever the
tokenizer.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from t6.data.shards import Manifest, ShardError, write_shard
from t6.data.tokenizer import ASSETS, Tokenizer, gpt2, sha256_file
from t6.errors import DamagedFile, MissingFile, SettingError

log = logging.getLogger(__name__)
TINY_SHAKESPEARE = ASSETS / "tinyshakespeare.txt"
VAL_FRACTION = 0.1  # a text corpus validates on its last tenth (data.val_fraction, the local tasks' held-out text)


def check_text(text_file: Path) -> None:
    """text_file is UTF-8 text: an empty file, a binary file or another encoding is an error naming the file and
    where it fails."""
    data = Path(text_file).read_bytes()
    if not data.strip():
        raise DamagedFile(f"data.text_file={str(text_file)!r} holds no text; give a UTF-8 text file with some in it")
    nul = data.find(bytes(1))
    if nul >= 0:
        raise DamagedFile(
            f"data.text_file={str(text_file)!r} is not text (a NUL byte at offset {nul}: a binary file?); give a "
            "UTF-8 text file"
        )
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DamagedFile(
            f"data.text_file={str(text_file)!r} is not UTF-8 text (byte {err.start}: {err.reason}); convert it, "
            "e.g. iconv -f LATIN1 -t UTF-8 FILE > FILE.utf8"
        ) from None


def text_source(text_file: Path, val_fraction: float) -> dict:
    """What the shards of a text corpus are made from, as their manifest records it: the file, its hash, the split."""
    return {"file": text_file.name, "sha256": sha256_file(text_file), "val_fraction": val_fraction}


def current_manifest(
    text_file: Path, out_dir: Path, val_fraction: float | None = None, tokenizer: Tokenizer | None = None
) -> Manifest | None:
    """The manifest of out_dir when its shards are text_file's, made as `prepare_text_corpus` makes them (the
    text's hash, the split, the tokenizer: GPT-2 BPE when None), whole; else None (they must be made)."""
    text_file, out_dir, tokenizer = Path(text_file), Path(out_dir), tokenizer or gpt2()
    if not text_file.is_file():
        return None
    val_fraction = VAL_FRACTION if val_fraction is None else val_fraction
    try:
        manifest = Manifest.load(out_dir)
        if manifest.source != text_source(text_file, val_fraction) or manifest.tokenizer != tokenizer.id:
            return None
        for split in ("train", "val"):
            manifest.open(out_dir, split, tokenizer)
    except ShardError:
        return None
    return manifest


def text_tokens(text_file: Path) -> np.ndarray:
    """The corpus as one document: <|endoftext|> then its GPT-2 tokens, uint16."""
    enc = gpt2()
    return np.array([enc.eot, *enc.encode(Path(text_file).read_text(encoding="utf-8"))], dtype=np.uint16)


def validation_start(n_tokens: int, val_fraction: float | None = None) -> int:
    """Where a corpus of n_tokens tokens splits: training before, validation (the last val_fraction) after."""
    return n_tokens - int(n_tokens * (VAL_FRACTION if val_fraction is None else val_fraction))


def split_text(text_file: Path, val_fraction: float | None = None) -> tuple[str, str]:
    """(training text, validation text): the corpus split where its GPT-2 tokens split (`validation_start`)."""
    tokens = text_tokens(text_file)
    start = validation_start(len(tokens), val_fraction)
    enc = gpt2()
    return enc.decode(tokens[1:start].tolist()), enc.decode(tokens[start:].tolist())


def held_out_text(text_file: Path, val_fraction: float | None = None) -> str:
    """The validation part of the corpus as `prepare_text_corpus` splits it, from its first full line:
    text no model trained on it has seen (the local evaluation tasks are built from it)."""
    text = split_text(text_file, val_fraction)[1]
    return text[text.index("\n") + 1 :]


def split_tokens(text_file: Path, val_fraction: float | None, tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(training tokens, validation tokens) of the corpus. GPT-2: the corpus tokenized whole, split at
    `validation_start`; another tokenizer: each part of `split_text` tokenized after <|endoftext|>."""
    if tokenizer == gpt2():
        tokens = text_tokens(text_file)
        start = validation_start(len(tokens), val_fraction)
        return tokens[:start], tokens[start:]
    return tuple(
        np.array([tokenizer.eot, *tokenizer.encode(part)], dtype=tokenizer.dtype)
        for part in split_text(text_file, val_fraction)
    )


def prepare_text_corpus(
    text_file: Path, out_dir: Path, val_fraction: float | None = None, tokenizer: Tokenizer | None = None
) -> Manifest:
    """Tokenize text_file (GPT-2 BPE, or `tokenizer`) into out_dir: the first (1 - val_fraction) of the
    text trains, the rest validates. Returns the manifest, reusing the cached shards when current."""
    text_file, out_dir = Path(text_file), Path(out_dir)
    tokenizer = tokenizer or gpt2()
    if not text_file.is_file():
        raise MissingFile(f"data.text_file={str(text_file)!r} does not exist")
    val_fraction = VAL_FRACTION if val_fraction is None else val_fraction
    if not 0 < val_fraction < 1:
        raise SettingError(f"data.val_fraction={val_fraction} must be between 0 and 1")
    manifest = current_manifest(text_file, out_dir, val_fraction, tokenizer)
    if manifest is not None:
        return manifest
    if (out_dir / "manifest.json").exists():
        log.info("%s or the tokenizer changed since its shards were made; rebuilding them", text_file)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = []
    for split, part in zip(("train", "val"), split_tokens(text_file, val_fraction, tokenizer)):
        name = f"{split}_000000.bin"
        write_shard(out_dir / name, part)
        shards.append({"file": name, "split": split, "tokens": int(part.size)})
    manifest = Manifest(
        tokenizer=tokenizer.id,
        source=text_source(text_file, val_fraction),
        shards=shards,
        tokenizer_name=tokenizer.name,
    )
    manifest.save(out_dir)
    log.info(
        "tokenized %s with %s: %s train / %s val tokens in %s",
        text_file.name,
        tokenizer.name,
        shards[0]["tokens"],
        shards[1]["tokens"],
        out_dir,
    )
    return manifest
