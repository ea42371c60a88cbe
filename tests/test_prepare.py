"""Data preparation through `datasets` on a local JSONL corpus (the same code path as FineWeb-Edu)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import t6.data.prepare as prepare
from t6.data.corpus import TINY_SHAKESPEARE
from t6.data.shards import Manifest, ShardError, read_shard
from t6.data.tokenizer import EOT, gpt2_encoding, tokenizer_id

SHARD = 1000


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """~120 documents (Shakespeare's speeches) as JSONL, and the token stream they must become."""
    docs = [d for d in TINY_SHAKESPEARE.read_text().split("\n\n")[:120] if d]
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    enc = gpt2_encoding()
    expected = np.concatenate([np.array([EOT, *enc.encode_ordinary(d)], dtype=np.uint16) for d in docs])
    return path, expected


def tokens_of(out_dir) -> np.ndarray:
    manifest = Manifest.load(out_dir)
    assert manifest.shards[0]["split"] == "val" and all(s["split"] == "train" for s in manifest.shards[1:])
    return np.concatenate([read_shard(out_dir / s["file"], s["tokens"]) for s in manifest.shards])


def run(corpus_path, out_dir, **kw):
    return prepare.prepare_dataset(out_dir, path="json", config=None, data_files=str(corpus_path), shard_tokens=SHARD,
                                   num_proc=2, docs_per_task=7, progress_bar=False, **kw)


def test_prepare_writes_eot_prefixed_shards_of_fixed_size(corpus, tmp_path):
    path, expected = corpus
    manifest = run(path, tmp_path / "out")
    assert manifest.tokenizer == tokenizer_id()
    assert [s["tokens"] for s in manifest.shards[:-1]] == [SHARD] * (len(manifest.shards) - 1)
    assert np.array_equal(tokens_of(tmp_path / "out"), expected)  # every document, in order, each after <|endoftext|>
    assert run(path, tmp_path / "out") == manifest  # already prepared: nothing redone


def test_max_tokens_stops_early(corpus, tmp_path):
    path, expected = corpus
    run(path, tmp_path / "out", max_tokens=2 * SHARD + 5)
    assert np.array_equal(tokens_of(tmp_path / "out"), expected[: 2 * SHARD + 5])


def test_interrupted_prepare_resumes_and_skips_finished_shards(corpus, tmp_path, monkeypatch):
    path, expected = corpus
    out = tmp_path / "out"
    real_write, written = prepare.write_shard, []

    def crash_on_third(p, tokens):
        if len(written) == 2:
            p.with_name(p.name + ".tmp").write_bytes(b"partial")  # what a killed write leaves behind
            raise KeyboardInterrupt
        written.append(p.name)
        real_write(p, tokens)

    monkeypatch.setattr(prepare, "write_shard", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        run(path, out)
    assert not (out / "manifest.json").exists()
    with pytest.raises(ShardError, match="no manifest.json"):
        Manifest.load(out)
    mtimes = {name: (out / name).stat().st_mtime_ns for name in written}

    rewritten = []
    monkeypatch.setattr(prepare, "write_shard", lambda p, t: (rewritten.append(p.name), real_write(p, t)))
    run(path, out)
    assert not set(rewritten) & set(written)  # finished shards skipped ...
    assert {n: (out / n).stat().st_mtime_ns for n in written} == mtimes
    assert np.array_equal(tokens_of(out), expected)  # ... and the result is the uninterrupted one


def test_truncated_finished_shard_is_an_error_naming_it(corpus, tmp_path, monkeypatch):
    path, _ = corpus
    out = tmp_path / "out"
    real_write = prepare.write_shard
    calls = []

    def crash_on_second(p, tokens):
        if calls:
            raise KeyboardInterrupt
        calls.append(p)
        real_write(p, tokens)

    monkeypatch.setattr(prepare, "write_shard", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        run(path, out)
    monkeypatch.setattr(prepare, "write_shard", real_write)
    shard = out / "val_000000.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ShardError, match=f"shard {shard} is truncated"):
        run(path, out)


def test_missing_fineweb_shards_name_the_prepare_command(make_cfg, tmp_path):
    from hydra.utils import instantiate

    cfg = make_cfg("data=fineweb_edu", "data.batch_size=4", "data.global_batch_size=null")
    dm = instantiate(cfg.data)
    with pytest.raises(ShardError, match="prepare it with: python prepare.py dataset=fineweb_edu"):
        dm.setup("fit")
