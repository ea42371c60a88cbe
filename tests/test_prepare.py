"""Data preparation through `datasets` on a local JSONL corpus (the same code path as FineWeb-Edu)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

import t6.data.prepare as prepare
from t6.data.corpus import TINY_SHAKESPEARE
from t6.data.shards import Manifest, ShardError, read_shard
from t6.data.tokenizer import EOT, gpt2, gpt2_encoding

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
    return prepare.prepare_dataset(
        out_dir,
        path="json",
        config=None,
        data_files=str(corpus_path),
        shard_tokens=SHARD,
        num_proc=2,
        docs_per_task=7,
        progress_bar=False,
        **kw,
    )


def test_prepare_writes_eot_prefixed_shards_of_fixed_size(corpus, tmp_path):
    path, expected = corpus
    manifest = run(path, tmp_path / "out")
    assert manifest.tokenizer == gpt2().id
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


@pytest.fixture(scope="module")
def five_mb_jsonl(tmp_path_factory):
    """~5 MB of JSONL made from the shipped Tiny Shakespeare: its speeches, repeated, one document a line."""
    docs = [d for d in TINY_SHAKESPEARE.read_text().split("\n\n") if d]
    path = tmp_path_factory.mktemp("local") / "docs.jsonl"
    with open(path, "w") as f:
        while f.tell() < 5_000_000:
            f.write("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


@pytest.mark.slow  # tokenizes 5 MB and trains twice (~1 min on 2 cores)
def test_a_small_local_file_prepares_and_trains_with_the_defaults(five_mb_jsonl, tmp_path, monkeypatch, caplog):
    """`python prepare.py dataset=local ...` as typed (shard size from the data) prints the train command, which
    trains with the data=local defaults."""
    import logging

    from omegaconf import open_dict

    from t6.run.train import main as train

    from conftest import ROOT, TEST_SIZE, compose_config

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    done = subprocess.run(
        [
            sys.executable,
            "prepare.py",
            "dataset=local",
            f"dataset.data_files={five_mb_jsonl}",
            f"paths.root_dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out_dir = tmp_path / "data" / "local"
    hint = done.stdout.strip().splitlines()[-1]  # the command it prints, as a user would copy it
    assert hint == f"train on it with: python train.py data=local data.data_dir={out_dir}"
    counts = [s["tokens"] for s in Manifest.load(out_dir).shards]
    assert 8 <= len(counts) <= 12 and counts[0] < sum(counts) / 5  # ~10 shards, validation ~10%
    assert not (out_dir / prepare.PROGRESS).exists()  # the manifest marks it done

    run = [
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "logger=none",
        "eval=none",
        "print_config=false",
        "callbacks.rich_model_summary=null",
    ]
    cfg = compose_config([*hint.split("python train.py ")[1].split(), *TEST_SIZE, *run], tmp_path)
    assert cfg.data.global_batch_size is None
    with caplog.at_level(logging.INFO, logger="t6.run.execute"):
        metrics, objects = train(cfg)
    assert objects["trainer"].global_step == 3 and objects["trainer"].accumulate_grad_batches == 1
    assert np.isfinite(metrics["val/loss"]) and "1 accumulation step(s)" in caplog.text

    with open_dict(cfg):  # accumulation is announced when there is any
        cfg.data.global_batch_size = 4 * cfg.data.batch_size
        cfg.trainer.max_steps = 1
        cfg.paths.output_dir = str(tmp_path / "accumulate")
    with caplog.at_level(logging.INFO, logger="t6.run.execute"):
        train(cfg)
    assert "4 accumulation step(s)" in caplog.text  # the run plan's batch line


def test_a_rerun_with_another_shard_size_starts_over(corpus, tmp_path, monkeypatch):
    """An unfinished run's progress.json does not block a re-run of the same data with other settings."""
    out = tmp_path / "out"
    real_write = prepare.write_shard

    def crash_on_fifth(p, tokens):
        if p.name == prepare.shard_name(4):
            p.with_name(p.name + ".tmp").write_bytes(b"partial")
            raise KeyboardInterrupt
        real_write(p, tokens)

    monkeypatch.setattr(prepare, "write_shard", crash_on_fifth)
    with pytest.raises(KeyboardInterrupt):
        run(corpus[0], out)  # 1000-token shards, interrupted: progress.json and four shards remain
    monkeypatch.setattr(prepare, "write_shard", real_write)
    assert (out / prepare.PROGRESS).is_file()
    manifest = prepare.prepare_dataset(
        out, path="json", config=None, data_files=str(corpus[0]), shard_tokens=3000, num_proc=2, progress_bar=False
    )
    assert [s["tokens"] for s in manifest.shards[:-1]] == [3000] * (len(manifest.shards) - 1)
    np.testing.assert_array_equal(tokens_of(out), corpus[1])
    assert sorted(p.name for p in out.glob("*.bin*")) == sorted(s["file"] for s in manifest.shards)  # no stale shards
    assert not (out / prepare.PROGRESS).exists()


def test_a_corpus_smaller_than_one_shard_is_split_into_validation_and_training(corpus, tmp_path):
    manifest = prepare.prepare_dataset(
        tmp_path / "one",
        path="json",
        config=None,
        data_files=str(corpus[0]),
        shard_tokens=10**9,
        num_proc=2,
        progress_bar=False,
    )
    counts = [s["tokens"] for s in manifest.shards]
    assert len(counts) == 2 and counts[0] == sum(counts) // 10
    np.testing.assert_array_equal(tokens_of(tmp_path / "one"), corpus[1])


def test_auto_shard_size_follows_the_files(tmp_path):
    small, missing = tmp_path / "a.jsonl", tmp_path / "nope.jsonl"
    small.write_bytes(b"x" * 4_000_000)
    assert prepare.auto_shard_tokens(str(small)) == 100_000
    assert prepare.auto_shard_tokens([str(small), str(small)]) == 200_000
    assert prepare.auto_shard_tokens(str(missing)) == prepare.auto_shard_tokens(None) == 100_000_000


@pytest.mark.parametrize(
    "builder, file, fix",
    [
        ("json", "corpus.txt", "dataset.path=text (one document per line)"),
        ("json", "a.parquet", "dataset.path=parquet"),
        ("text", "docs.jsonl.gz", "dataset.path=json"),
    ],
)
def test_a_file_of_another_kind_than_the_builder_names_the_builder(builder, file, fix, tmp_path):
    (tmp_path / file).write_text("To be, or not to be\n")
    with pytest.raises(ValueError, match=re.escape(f"set {fix}")):
        prepare.prepare_dataset(tmp_path / "out", path=builder, config=None, data_files=str(tmp_path / file))
    assert not (tmp_path / "out").exists()  # nothing written


def test_a_text_file_prepares_with_the_text_builder(tmp_path):
    lines = [line for line in TINY_SHAKESPEARE.read_text().splitlines()[:400] if line]
    (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n")
    manifest = prepare.prepare_dataset(
        tmp_path / "out",
        path="text",
        config=None,
        data_files=str(tmp_path / "corpus.txt"),
        shard_tokens=SHARD,
        num_proc=1,
        progress_bar=False,
    )
    enc = gpt2_encoding()
    expected = np.concatenate([np.array([EOT, *enc.encode_ordinary(line)], dtype=np.uint16) for line in lines])
    assert len(manifest.shards) >= 2 and np.array_equal(tokens_of(tmp_path / "out"), expected)
