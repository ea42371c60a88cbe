"""Tokenize a Hugging Face text data set (FineWeb-Edu, or local JSONL / parquet) into token shards.

`python prepare.py dataset=fineweb_edu` streams `HuggingFaceFW/fineweb-edu` (sample-10BT) through
`datasets` (nothing is downloaded up front), tokenizes the documents in a process pool with GPT-2
BPE or the `tokenizer` given (t6.data.tokenizer), each prefixed with its end-of-text token, and
writes shards of `shard_tokens` tokens with t6.data.shards (header, atomic rename). Shard 0 is the
validation split. Progress (shards finished, and the document/offset where the next shard starts)
is saved after every shard, so an interrupted run continues where it stopped: finished shards are
checked and skipped, a partial shard (a *.tmp file) is never taken as complete. The manifest,
written last, marks the data set done. `main` is what `python prepare.py` runs.
"""

from __future__ import annotations

import glob
import json
import logging
import multiprocessing as mp
import os
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import numpy as np

from t6.data.shards import Manifest, ShardError, read_shard, write_shard
from t6.data.tokenizer import Tokenizer, from_spec, gpt2
from t6.errors import MissingFile, SettingError

log = logging.getLogger(__name__)
PROGRESS = "progress.json"
_TOKENIZER: Tokenizer | None = None


def _init_worker(spec: dict) -> None:
    global _TOKENIZER
    _TOKENIZER = from_spec(spec)


def _tokenize(texts: list[str]) -> list[np.ndarray]:
    """[end of text, *tokens] per document, in the tokenizer's dtype."""
    tok = _TOKENIZER
    return [np.array([tok.eot, *ids], dtype=tok.dtype) for ids in tok.encode_batch(texts)]


def _batches(texts: Iterator[str], size: int) -> Iterator[list[str]]:
    while batch := list(islice(texts, size)):
        yield batch


def shard_name(i: int) -> str:
    return f"{'val' if i == 0 else 'train'}_{i:06d}.bin"


AUTO_SHARDS = 10  # shard_tokens=auto: about this many shards (the first, validation, ~10% of the data) ...
MAX_SHARD_TOKENS = 100_000_000  # ... of at most 100M tokens (200 MB)
BYTES_PER_TOKEN = 4  # GPT-2 BPE on English text, JSON or parquet overhead included: a rough, safe estimate


def auto_shard_tokens(data_files: str | list[str] | None) -> int:
    """Shard size for `shard_tokens=auto`: the local files' size in estimated tokens / AUTO_SHARDS,
    at most MAX_SHARD_TOKENS; MAX_SHARD_TOKENS for a remote data set (no files to measure)."""
    files = [data_files] if isinstance(data_files, str) else list(data_files or [])
    paths = [Path(f) for f in files]
    if not paths or not all(p.is_file() for p in paths):
        return MAX_SHARD_TOKENS
    estimate = sum(p.stat().st_size for p in paths) // BYTES_PER_TOKEN
    return max(1, min(MAX_SHARD_TOKENS, estimate // AUTO_SHARDS))


# The `datasets` builder that reads a local file of each kind (dataset.path).
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv"}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")


def check_builder(path: str, data_files: str | list[str] | None) -> None:
    """Local files: each exists (or its glob pattern matches some), and is read by the builder of its kind (one read
    by another fails deep in pyarrow: a 40-line JSON parse traceback for a .txt file under dataset.path=json); each
    problem names the setting to change."""
    if data_files is None or path not in FILE_BUILDERS.values():
        return
    files = [data_files] if isinstance(data_files, str) else list(data_files)
    for file in files:
        pattern = str(Path(str(file)).expanduser())
        if not (glob.glob(pattern, recursive=True) if glob.has_magic(pattern) else Path(pattern).exists()):
            what = "matches no file" if glob.has_magic(pattern) else "does not exist"
            raise MissingFile(
                f"dataset.data_files={str(file)!r} {what}; "
                "give the path of a local .jsonl, .parquet, .txt or .csv file (or a glob pattern that matches some)"
            )
    for file in files:
        name = Path(str(file)).name.lower()
        for ext in COMPRESSED:
            name = name.removesuffix(ext)
        kind = Path(name).suffix
        builder = FILE_BUILDERS.get(kind)
        if builder is not None and builder != path:
            per_line = " (one document per line)" if builder == "text" else ""
            raise SettingError(
                f"dataset.data_files={str(file)!r} is a {kind} file, which dataset.path={path} cannot read; "
                f"set dataset.path={builder}{per_line}"
            )


def _restartable(saved: dict, source: dict, tokenizer: Tokenizer) -> bool:
    """A progress file of the same data and tokenizer whose only difference is the shard size or token limit."""
    same = ("path", "config", "split", "data_files", "text_field")
    return saved.get("tokenizer") == tokenizer.id and all(saved.get("source", {}).get(k) == source[k] for k in same)


def _discard(out_dir: Path, progress_file: Path) -> None:
    """Remove the shards a progress file lists (and any partial shard), then the progress file."""
    for path in [*out_dir.glob("val_*.bin*"), *out_dir.glob("train_*.bin*")]:
        path.unlink()
    progress_file.unlink(missing_ok=True)


def check_text_field(ds, text_field: str, where) -> None:
    """The first row of the data set has `text_field`, holding text; else an error naming the field, what the rows
    have and the setting that chooses it."""
    first = next(iter(ds), None)
    if first is None:
        raise SettingError(f"{where}: the data set has no rows; check dataset.data_files (or dataset.path and split)")
    if text_field not in first:
        raise SettingError(
            f"dataset.text_field={text_field!r}: the rows of {where} have no such field (they have: "
            f"{', '.join(sorted(map(str, first)))}); set dataset.text_field to the one holding the text"
        )
    if not isinstance(first[text_field], str):
        raise SettingError(
            f"dataset.text_field={text_field!r} of {where} holds {type(first[text_field]).__name__}, not text; "
            "set dataset.text_field to the field holding the documents' text"
        )


def prepare_dataset(
    out_dir: str | Path,
    path: str = "HuggingFaceFW/fineweb-edu",
    config: str | None = "sample-10BT",
    split: str = "train",
    data_files: str | list[str] | None = None,
    text_field: str = "text",
    shard_tokens: int | str = 100_000_000,
    max_tokens: int | None = None,
    num_proc: int | None = 8,
    docs_per_task: int = 64,
    progress_bar: bool = True,
    tokenizer: Tokenizer | None = None,
) -> Manifest:
    """Write token shards of the data set to out_dir and return its manifest (see module doc);
    tokenizer: GPT-2 BPE when None."""
    import datasets
    from tqdm import tqdm

    tokenizer = tokenizer or gpt2()
    check_builder(path, data_files)
    out_dir = Path(out_dir)
    source = {
        "path": path,
        "config": config,
        "split": split,
        "data_files": data_files,
        "text_field": text_field,
        "shard_tokens": shard_tokens,
        "max_tokens": max_tokens,
    }
    if shard_tokens == "auto":
        shard_tokens = auto_shard_tokens(data_files)
        log.info("dataset.shard_tokens=auto: %d tokens per shard", shard_tokens)
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise SettingError(f"dataset.shard_tokens={shard_tokens!r} must be a positive number of tokens or `auto`")
    num_proc = num_proc or min(8, os.cpu_count() or 1)
    try:
        manifest = Manifest.load(out_dir)
    except ShardError:
        manifest = None
    if manifest is not None:
        if manifest.source != source or manifest.tokenizer != tokenizer.id:
            raise ShardError(
                f"{out_dir} already holds a different data set ({manifest.source}, tokenizer "
                f"{manifest.tokenizer_name or 'gpt2'}); choose another dataset.out_dir"
            )
        log.info("%s is already prepared", out_dir)
        return manifest

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {"source": source, "tokenizer": tokenizer.id, "shards": [], "next_doc": 0, "next_offset": 0}
    progress_file = out_dir / PROGRESS
    if progress_file.is_file():
        saved = json.loads(progress_file.read_text())
        if saved.get("source") == source and saved.get("tokenizer") == tokenizer.id:
            for s in saved["shards"]:
                read_shard(out_dir / s["file"], s["tokens"])  # a finished shard must still be whole
            state = saved
            log.info("resuming: %d shards already finished in %s", len(state["shards"]), out_dir)
        elif _restartable(saved, source, tokenizer):  # the same data, re-run with another shard size or token limit
            log.warning(
                "%s: an unfinished run with shard_tokens=%s, max_tokens=%s; starting over with shard_tokens=%s, "
                "max_tokens=%s",
                out_dir,
                saved["source"].get("shard_tokens"),
                saved["source"].get("max_tokens"),
                source["shard_tokens"],
                max_tokens,
            )
            _discard(out_dir, progress_file)
        else:
            raise ShardError(
                f"{progress_file} is an unfinished run over another data set or tokenizer "
                f"({saved.get('source')}); delete {out_dir} or choose another dataset.out_dir"
            )

    ds = datasets.load_dataset(path, name=config, split=split, data_files=data_files, streaming=True)
    check_text_field(ds, text_field, data_files or path)
    if state["next_doc"]:
        ds = ds.skip(state["next_doc"])
    texts = (row[text_field] for row in ds)
    done_tokens = sum(s["tokens"] for s in state["shards"])
    bar = tqdm(
        total=max_tokens,
        initial=done_tokens,
        unit="tok",
        unit_scale=True,
        disable=not progress_bar,
        desc=str(out_dir.name),
    )

    buffer: list[np.ndarray] = []
    buffered = 0
    doc = state["next_doc"]
    skip_tokens = state["next_offset"]

    def save_progress() -> None:
        tmp = progress_file.with_name(PROGRESS + ".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, progress_file)

    def flush(tokens: np.ndarray, next_doc: int, next_offset: int) -> None:
        i = len(state["shards"])
        write_shard(out_dir / shard_name(i), tokens)
        state["shards"].append(
            {"file": shard_name(i), "split": "val" if i == 0 else "train", "tokens": int(tokens.size)}
        )
        state["next_doc"], state["next_offset"] = next_doc, next_offset
        save_progress()

    limit = None if max_tokens is None else max_tokens - done_tokens
    batches = _batches(texts, docs_per_task)
    with mp.get_context("fork").Pool(num_proc, initializer=_init_worker, initargs=(tokenizer.spec(),)) as pool:
        # The main thread reads a bounded group of batches, then the pool tokenizes them: the pool's
        # own threads never pull from the data set, so an interrupt terminates idle workers cleanly.
        while limit is None or limit > 0:
            group = list(islice(batches, 4 * num_proc))
            if not group:
                break
            for docs in pool.map(_tokenize, group):
                for tokens in docs:
                    offset, skip_tokens = skip_tokens, 0  # tokens of this document already in earlier shards
                    while offset < tokens.size and (limit is None or limit > 0):
                        take = min(
                            tokens.size - offset, shard_tokens - buffered, limit if limit is not None else shard_tokens
                        )
                        buffer.append(tokens[offset : offset + take])
                        buffered, offset = buffered + take, offset + take
                        limit = None if limit is None else limit - take
                        bar.update(take)
                        if buffered == shard_tokens:  # the next shard starts at (document, offset)
                            flush(np.concatenate(buffer), *((doc, offset) if offset < tokens.size else (doc + 1, 0)))
                            buffer, buffered = [], 0
                    doc += 1
                    if limit is not None and limit <= 0:
                        break
                if limit is not None and limit <= 0:
                    break
    if buffered and not state["shards"]:  # everything fits one shard: a tenth of it (at least a token) validates
        tokens = np.concatenate(buffer)
        if tokens.size >= 2:
            val = max(1, tokens.size // AUTO_SHARDS)
            write_shard(out_dir / shard_name(0), tokens[:val])
            state["shards"].append({"file": shard_name(0), "split": "val", "tokens": int(val)})
            buffer, buffered = [tokens[val:]], tokens.size - val
            log.info(
                "the data set fits one shard of %d tokens: split into %d validation and %d training tokens",
                shard_tokens,
                val,
                buffered,
            )
    if buffered:
        flush(np.concatenate(buffer), doc, 0)
    bar.close()
    if len(state["shards"]) < 2:
        total = sum(s["tokens"] for s in state["shards"])
        _discard(out_dir, progress_file)  # nothing a re-run could continue from
        raise SettingError(
            f"{path} ({data_files or config}) gave {total} tokens: too few for a validation and a training shard"
        )
    manifest = Manifest(tokenizer=tokenizer.id, source=source, shards=state["shards"], tokenizer_name=tokenizer.name)
    manifest.save(out_dir)
    progress_file.unlink(missing_ok=True)  # the manifest marks the data set done
    log.info(
        "prepared %s: %d shards, %d tokens", out_dir, len(state["shards"]), sum(s["tokens"] for s in state["shards"])
    )
    return manifest


def main(cfg) -> Manifest:
    """prepare.py: prepare the `dataset` group's data set (conf/prepare.yaml), print what was written and the
    command that trains on it."""
    from t6.data.tokenizer import load_tokenizer

    d = cfg.dataset
    manifest = prepare_dataset(
        d.out_dir,
        path=d.path,
        config=d.config,
        split=d.split,
        data_files=d.data_files,
        text_field=d.text_field,
        shard_tokens=d.shard_tokens,
        max_tokens=d.max_tokens,
        num_proc=d.num_proc,
        tokenizer=load_tokenizer(cfg.tokenizer),
    )
    tokens = sum(s["tokens"] for s in manifest.shards)
    print(f"{d.out_dir}: {len(manifest.shards)} shards, {tokens:,} tokens (shard 0 is validation)")
    with_tokenizer = "" if cfg.tokenizer in (None, "gpt2") else f" tokenizer={cfg.tokenizer}"
    print(f"train on it with: python train.py data={d.data_config} data.data_dir={d.out_dir}{with_tokenizer}")
    return manifest
