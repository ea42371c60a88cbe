"""Token shards, the embedded corpus cache and the deterministic training stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from t6.data.batching import sequences_per_step, world_size
from t6.data.corpus import TINY_SHAKESPEARE, prepare_text_corpus
from t6.data.datamodule import TokenDataModule, TrainStream, Windows
from t6.data.shards import Manifest, ShardError, read_shard, write_shard
from t6.data.tokenizer import EOT, GPT2_RANKS_SHA256, gpt2, gpt2_encoding, sha256_file


def test_shipped_assets_are_the_expected_files():
    assert sha256_file(TINY_SHAKESPEARE) == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    enc = gpt2_encoding()
    assert enc.n_vocab == 50257 and enc.eot_token == EOT
    assert enc.encode("Hello world") == [15496, 995]  # GPT-2's ids
    assert GPT2_RANKS_SHA256.startswith("306cd27f")


def test_shard_round_trip_and_corruption(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    write_shard(tmp_path / "a.bin", tokens)
    assert np.array_equal(read_shard(tmp_path / "a.bin", 1000), tokens)
    with pytest.raises(ShardError, match="lists 999"):
        read_shard(tmp_path / "a.bin", 999)
    (tmp_path / "b.bin").write_bytes(b"\0" * 2048)
    with pytest.raises(ShardError, match="bad magic"):
        read_shard(tmp_path / "b.bin")
    with pytest.raises(ShardError, match="missing"):
        read_shard(tmp_path / "c.bin")
    assert not list(tmp_path.glob("*.tmp"))


def test_corpus_cache_is_reused_and_rebuilt_when_the_source_changes(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 200)
    out = tmp_path / "shards"
    m1 = prepare_text_corpus(text, out)
    mtime = (out / "train_000000.bin").stat().st_mtime_ns
    prepare_text_corpus(text, out)
    assert (out / "train_000000.bin").stat().st_mtime_ns == mtime  # cached
    text.write_text("Now is the winter of our discontent.\n" * 300)
    m2 = prepare_text_corpus(text, out)
    assert m2.source["sha256"] != m1.source["sha256"]
    train = Manifest.load(out).open(out, "train", gpt2())[0]
    assert train[0] == EOT and gpt2_encoding().decode(train[1:9].tolist()).startswith("Now is the winter")


def test_tokenizer_mismatch_is_rejected_naming_both(tmp_path):
    from t6.data.tokenizer import PretrainedTokenizer

    from tiny_llama import tiny_tokenizer

    prepare_text_corpus(TINY_SHAKESPEARE, tmp_path)
    other = PretrainedTokenizer(tiny_tokenizer().to_str(), "tiny-bpe", eot=1)
    with pytest.raises(
        ShardError, match=rf"made with tokenizer gpt2 \(gpt2-bpe:.*uses tokenizer tiny-bpe \({other.id}"
    ):
        Manifest.load(tmp_path).open(tmp_path, "train", other)


def test_stream_is_deterministic_disjoint_across_ranks_and_resumable():
    windows = Windows([np.arange(10_001, dtype=np.uint16)], seq_len=10)  # 1000 windows

    def take(start, rank, world, n):
        it = iter(TrainStream(windows, seed=3, shuffle=True, start=start, rank=rank, world_size=world))
        return [next(it)[0][0].item() for _ in range(n)]

    single = take(0, 0, 1, 40)
    assert single == take(0, 0, 1, 40)
    r0, r1 = take(0, 0, 2, 20), take(0, 1, 2, 20)
    assert r0 == single[0::2] and r1 == single[1::2] and not set(r0) & set(r1)
    assert take(24, 0, 1, 16) == single[24:]  # resuming at a sample index continues the same stream
    x, y = next(iter(TrainStream(windows, 0, False, 0, 0, 1)))
    assert torch.equal(y[:-1], x[1:])  # targets are the inputs shifted by one


def test_loader_workers_keep_the_streams_order():
    from torch.utils.data import DataLoader

    windows = Windows([np.arange(10_001, dtype=np.uint16)], seq_len=10)  # 1000 windows
    single = iter(TrainStream(windows, seed=3, shuffle=True, start=8, rank=1, world_size=2))
    expected = [next(single)[0][0].item() for _ in range(7 * 4)]

    def batches(workers: int) -> list[int]:
        stream = TrainStream(windows, seed=3, shuffle=True, start=8, rank=1, world_size=2, batch_size=4)
        it = iter(DataLoader(stream, batch_size=4, num_workers=workers))
        return [v for _ in range(7) for v in next(it)[0][:, 0].tolist()]

    assert batches(0) == expected
    assert batches(3) == expected  # 7 batches over 3 workers: each worker's share interleaved back in order


def test_global_batch_must_divide():
    dm = TokenDataModule("unused", seq_len=8, batch_size=6, global_batch_size=480)
    assert dm.accumulation(world_size=8) == 10
    with pytest.raises(ValueError, match="global_batch_size=480 is not divisible"):
        dm.accumulation(world_size=7)


def test_sequences_per_step_is_the_global_batch_else_micro_batch_times_world():
    assert sequences_per_step(6, 480, world_size=8) == 480  # 6 x 8 x 10 accumulation steps
    assert sequences_per_step(6, None, world_size=8) == 48  # no accumulation
    assert sequences_per_step("auto", 480, world_size=None) == 480
    assert world_size(4, num_nodes=2) == 8 and world_size([0, 1]) == 2 and world_size(3, None) == 3
    assert world_size("auto") is None and world_size(-1) is None
    with pytest.raises(ValueError, match="set data.global_batch_size or trainer.devices=N"):
        sequences_per_step(6, None, world_size=None)
    with pytest.raises(ValueError, match="data.batch_size=auto needs data.global_batch_size"):
        sequences_per_step("auto", None, world_size=8)


def test_validation_batches_have_one_shape_and_the_padding_counts_for_nothing():
    from torch.utils.data import DataLoader

    from t6.data.datamodule import ValWindows
    from t6.model import ModelConfig
    from t6.model.loss import IGNORE_INDEX
    from t6.training.module import T6LitModule

    windows = Windows([np.arange(1, 10_001, dtype=np.uint16) % 97], seq_len=10)
    padded = ValWindows(windows, max_windows=7, multiple=4)  # 7 windows -> 8 rows: one of padding
    batches = list(DataLoader(padded, batch_size=4))
    assert [tuple(x.shape) for x, _ in batches] == [(4, 10), (4, 10)]
    assert (batches[1][1][3] == IGNORE_INDEX).all() and (batches[1][1][:3] != IGNORE_INDEX).all()
    cfg = ModelConfig(attention="mha", n_layer=1, d_model=32, n_head=2, head_dim=16, block_size=16, vocab_size=97)
    module = T6LitModule(model_config=vars(cfg)).eval()
    with torch.no_grad():
        for i, batch in enumerate(batches):
            module.validation_step(batch, i)
        real = [windows.get(w) for w in range(7)]
        mean = sum(module.loss((x[None], y[None])) for x, y in real) / 7  # every window has 10 tokens
    torch.testing.assert_close(module.val_loss.compute(), mean, rtol=1e-6, atol=1e-6)
