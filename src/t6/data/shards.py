"""Token shards: flat token files with a small header, listed in a manifest.

A shard is a 1024-byte header (int32: magic, version, token count, bytes per token, then zeros)
followed by the tokens as uint16, or uint32 for a vocabulary of more than 65,536 tokens (Llama 3's
128k), read back with np.memmap (nanoGPT / llm.c style). Shards written before the header named the
bytes per token hold zero there: uint16. A directory of
shards has a `manifest.json` naming each shard, its split and token count, the tokenizer
and the source it was made from. Shards and the manifest are written to a temporary
name and renamed into place, so an interrupted write never leaves a file that looks complete.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from t6.data.tokenizer import Tokenizer
from t6.errors import UserError

MAGIC = 20250106  # arXiv 2501.06425
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MANIFEST = "manifest.json"


class ShardError(UserError, RuntimeError):
    """A shard or manifest is missing, truncated, corrupted or from another tokenizer: prepare the data again."""


TOKEN_TYPES = {2: np.uint16, 4: np.uint32}  # bytes per token -> type


def write_shard(path: Path, tokens: np.ndarray) -> None:
    """tokens (uint16 or uint32, as the tokenizer's `dtype`) into a shard at path, atomically."""
    if tokens.dtype not in (np.uint16, np.uint32):
        raise ValueError(f"shard tokens must be uint16 or uint32 (the tokenizer's dtype), not {tokens.dtype}")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:4] = (MAGIC, VERSION, tokens.size, tokens.dtype.itemsize)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # one per process: concurrent writers never share it
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_shard(path: Path, expected_tokens: int | None = None) -> np.memmap:
    """Memory-map a shard's tokens after checking its header and size; errors name the file."""
    if not path.is_file():
        raise ShardError(f"shard {path} is missing; re-run data preparation for {path.parent}")
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    if header.size < HEADER_INTS or header[0] != MAGIC:
        raise ShardError(f"shard {path} has no valid header (bad magic); delete it and re-run data preparation")
    if header[1] != VERSION:
        raise ShardError(f"shard {path} has format version {header[1]}, this code reads {VERSION}")
    n, width = int(header[2]), int(header[3]) or 2
    if width not in TOKEN_TYPES:
        raise ShardError(f"shard {path} has {width} bytes per token in its header (2 or 4); delete it and re-run")
    size = path.stat().st_size
    if size != HEADER_BYTES + width * n:
        raise ShardError(
            f"shard {path} is truncated or corrupted: header says {n} tokens ({HEADER_BYTES + width * n} bytes), "
            f"file has {size} bytes; delete it and re-run data preparation"
        )
    if expected_tokens is not None and n != expected_tokens:
        raise ShardError(f"shard {path} holds {n} tokens but {MANIFEST} lists {expected_tokens}")
    return np.memmap(path, dtype=TOKEN_TYPES[width], mode="r", offset=HEADER_BYTES, shape=(n,))


@dataclass
class Manifest:
    tokenizer: str  # the tokenizer's id (t6.data.tokenizer.Tokenizer.id)
    source: dict
    shards: list[dict]  # {"file": name, "split": "train" | "val", "tokens": n}
    tokenizer_name: str = ""  # what the tokenizer is, for people (gpt2, or where it was read from)

    def save(self, directory: Path) -> None:
        tmp = directory / f".{MANIFEST}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(self.__dict__, indent=2))
        os.replace(tmp, directory / MANIFEST)

    @classmethod
    def load(cls, directory: Path) -> Manifest:
        path = directory / MANIFEST
        if not path.is_file():
            raise ShardError(f"no {MANIFEST} in {directory}: the data set has not been prepared there")
        try:
            return cls(**json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError) as err:
            raise ShardError(f"{path} is not a valid manifest ({err}); delete it and re-run data preparation") from err

    def open(self, directory: Path, split: str, tokenizer: Tokenizer) -> list[np.memmap]:
        """Check the tokenizer (the run's must be the shards') and every shard of `split`, then memory-map them."""
        if self.tokenizer != tokenizer.id:
            made = f"tokenizer {self.tokenizer_name or 'gpt2'} ({self.tokenizer})"
            raise ShardError(
                f"the shards in {directory} were made with {made} but this run uses tokenizer {tokenizer.name} "
                f"({tokenizer.id}): token ids of one mean other text in the other; use one tokenizer for both "
                "(set tokenizer=, or prepare the data again with it)"
            )
        shards = [read_shard(directory / s["file"], s["tokens"]) for s in self.shards if s["split"] == split]
        if not shards:
            raise ShardError(f"{directory / MANIFEST} lists no {split!r} shard")
        return shards
