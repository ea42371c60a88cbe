"""Turn a plain-text corpus into token shards (the embedded default: Tiny Shakespeare).

The shards are a cache: they are rebuilt when the text or the tokenizer changes (both
are recorded in the manifest) and reused otherwise.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from t6.data.shards import Manifest, ShardError, write_shard
from t6.data.tokenizer import ASSETS, EOT, gpt2_encoding, sha256_file, tokenizer_id

log = logging.getLogger(__name__)
TINY_SHAKESPEARE = ASSETS / "tinyshakespeare.txt"


def prepare_text_corpus(text_file: Path, out_dir: Path, val_fraction: float = 0.1) -> Manifest:
    """Tokenize text_file with GPT-2 BPE into out_dir: the first (1 - val_fraction) of the tokens
    train, the rest validation. Returns the manifest, reusing the cached shards when current."""
    text_file, out_dir = Path(text_file), Path(out_dir)
    if not text_file.is_file():
        raise FileNotFoundError(f"data.text_file={str(text_file)!r} does not exist")
    if not 0 < val_fraction < 1:
        raise ValueError(f"data.val_fraction={val_fraction} must be between 0 and 1")
    source = {"file": text_file.name, "sha256": sha256_file(text_file), "val_fraction": val_fraction}
    try:
        manifest = Manifest.load(out_dir)
        if manifest.source == source and manifest.tokenizer == tokenizer_id():
            for split in ("train", "val"):
                manifest.open(out_dir, split, tokenizer_id())
            return manifest
        log.info("%s changed since its shards were made; rebuilding them", text_file)
    except ShardError:
        pass
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = gpt2_encoding().encode_ordinary(text_file.read_text(encoding="utf-8"))
    tokens = np.array([EOT, *ids], dtype=np.uint16)  # the document starts with <|endoftext|>
    n_val = int(len(tokens) * val_fraction)
    shards = []
    for split, part in (("train", tokens[: len(tokens) - n_val]), ("val", tokens[len(tokens) - n_val :])):
        name = f"{split}_000000.bin"
        write_shard(out_dir / name, part)
        shards.append({"file": name, "split": split, "tokens": int(part.size)})
    manifest = Manifest(tokenizer=tokenizer_id(), source=source, shards=shards)
    manifest.save(out_dir)
    log.info("tokenized %s: %d train / %d val tokens in %s", text_file.name, shards[0]["tokens"], n_val, out_dir)
    return manifest
