"""LightningDataModule over token shards, read by memmap.

Training reads an endless, deterministic stream of windows: sample s of the global
stream is window perm_epoch(s) of the training shards, and rank r of W takes samples
r, r + W, r + 2W, ... The stream position is a function of the optimizer step, saved in
the checkpoint, so a resumed run continues exactly where the interrupted one stopped.
Validation reads fixed, non-overlapping windows of the validation split, in batches of one shape (the
last padded with rows no loss counts). With
`num_workers` > 0, worker k of K builds the rank's batches k, k + K, ... and the DataLoader
hands them out round-robin, so the stream's order is the same for every worker count; batches
are pinned for the host-to-device copy on CUDA. Shards are prepared under a file lock, so the
ranks of a torchrun / SLURM job that all start on fresh data make them once. The run's tokenizer
(`tokenizer`, t6.data.tokenizer) must be the shards'; a text corpus is tokenized into a folder of
each tokenizer's own (`data_dir` for GPT-2, `data_dir-<tokenizer id>` for another).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from t6.data.batching import accumulation_steps, check_batch_settings, sequences_per_device, sequences_per_step
from t6.data.corpus import (
    TINY_SHAKESPEARE,
    check_text,
    current_manifest,
    prepare_text_corpus,
    split_tokens,
)
from t6.data.shards import Manifest, ShardError
from t6.data.tokenizer import Tokenizer, gpt2, load_tokenizer
from t6.errors import MissingFile, SettingError
from t6.model.loss import IGNORE_INDEX

SPLITS = ("train", "val")


def writable(path: Path) -> bool:
    """Whether path can be written, or made under the nearest directory above it that exists."""
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    return existing is not None and existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)


class Windows:
    """Aligned windows of seq_len + 1 tokens (input and shifted target) over a list of shards."""

    def __init__(self, shards: list[np.ndarray], seq_len: int):
        self.shards, self.seq_len = shards, seq_len
        self.counts = np.array([(len(s) - 1) // seq_len for s in shards], dtype=np.int64)  # windows per shard
        if self.counts.sum() == 0:
            raise SettingError(f"the shards hold fewer than data.seq_len + 1 = {seq_len + 1} tokens")
        self.offsets = np.concatenate(([0], np.cumsum(self.counts)))  # first window index of each shard

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def get(self, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard = int(np.searchsorted(self.offsets, w, side="right") - 1)
        start = (w - self.offsets[shard]) * self.seq_len
        chunk = torch.from_numpy(self.shards[shard][start : start + self.seq_len + 1].astype(np.int64))  # [T + 1]
        return chunk[:-1], chunk[1:]  # input [T], target [T]


class TrainStream(IterableDataset):
    """Endless stream of this rank's training windows, starting at global sample `start`. Inside a
    DataLoader worker (k of K), only the samples of the rank's batches k, k + K, ... of
    `batch_size` samples each, which the DataLoader interleaves back into the stream's order."""

    def __init__(
        self, windows: Windows, seed: int, shuffle: bool, start: int, rank: int, world_size: int, batch_size: int = 1
    ):
        self.windows, self.seed, self.shuffle = windows, seed, shuffle
        self.start, self.rank, self.world_size, self.batch_size = start, rank, world_size, batch_size

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        B, W, n = self.batch_size, self.world_size, len(self.windows)
        perm_epoch, perm = None, None
        batch = worker
        while True:
            for j in range(B):
                s = self.start + self.rank + (batch * B + j) * W  # the global sample index
                epoch, i = divmod(s, n)
                if self.shuffle and epoch != perm_epoch:
                    perm_epoch, perm = (
                        epoch,
                        np.random.default_rng((self.seed, epoch)).permutation(n),
                    )  # same on every rank
                yield self.windows.get(int(perm[i]) if self.shuffle else i)
            batch += workers


class ValWindows(Dataset):
    """The first `max_windows` validation windows (all when None), padded to a multiple of `multiple`
    with rows whose targets are all IGNORE_INDEX: every validation batch has one shape (a compiled model
    validates through one graph) and the padding counts in no loss."""

    def __init__(self, windows: Windows, max_windows: int | None, multiple: int = 1):
        self.windows, self.multiple = windows, multiple
        self.n = len(windows) if max_windows is None else min(len(windows), max_windows)

    def __len__(self) -> int:
        return -(-self.n // self.multiple) * self.multiple

    def __getitem__(self, i: int):
        if i < self.n:
            return self.windows.get(i)
        x = torch.zeros(self.windows.seq_len, dtype=torch.int64)  # [T]
        return x, torch.full_like(x, IGNORE_INDEX)  # input [T], target [T] that no loss counts


class TokenDataModule(L.LightningDataModule):
    """Token shards in `data_dir` (a manifest plus shards). With `text_file` set (or `embedded`),
    the shards are made from that text on first use; otherwise they must have been prepared."""

    def __init__(
        self,
        data_dir: str,
        seq_len: int,
        batch_size: int | str,
        global_batch_size: int | None = None,
        text_file: str | None = None,
        embedded: bool = False,
        val_fraction: float | None = None,
        val_windows: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        prepare_command: str | None = None,
        num_workers: int = 0,
        tokenizer: Tokenizer | str | None = None,
    ):
        """tokenizer: the run's tokenizer, or its setting (`tokenizer=`: gpt2, a pretrained model's directory
        or GGUF file, a checkpoint that records one; t6.data.tokenizer.load_tokenizer); None: GPT-2."""
        super().__init__()
        check_batch_settings(batch_size, global_batch_size, seq_len)
        self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        self.data_dir = Path(data_dir)
        self.seq_len, self.batch_size, self.global_batch_size = seq_len, batch_size, global_batch_size
        self.text_file = Path(text_file) if text_file else (TINY_SHAKESPEARE if embedded else None)
        if self.text_file is not None and self.tokenizer != gpt2():  # a text corpus: tokenized per tokenizer
            self.data_dir = self.data_dir.with_name(f"{self.data_dir.name}-{self.tokenizer.id.replace(':', '-')}")
        self.val_fraction, self.val_windows = val_fraction, val_windows
        self.shuffle, self.seed = shuffle, seed
        self.prepare_command = prepare_command  # how to make the shards, named when they are missing
        if num_workers < 0:
            raise SettingError(f"data.num_workers={num_workers} must be 0 (load in the training process) or more")
        self.num_workers = num_workers
        self.train_windows: Windows | None = None
        self.val_set: ValWindows | None = None
        self.resume_samples: int | None = None

    def per_device_batch(self, world_size: int) -> int:
        """Sequences each device handles per optimizer step: its share of data.global_batch_size."""
        return sequences_per_device(self.batch_size, self.global_batch_size, world_size)

    def accumulation(self, world_size: int) -> int:
        """Gradient-accumulation steps so that micro-batch x world size x steps = global batch."""
        return accumulation_steps(self.batch_size, self.global_batch_size, world_size)

    def prepare_data(self) -> None:
        if self.text_file is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            with open(self.data_dir / ".prepare.lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # the first process makes the shards; the others find them current
                prepare_text_corpus(self.text_file, self.data_dir, self.val_fraction, self.tokenizer)

    def check(self) -> None:
        """Before anything is built, reading only: the text the shards are made from (it exists, is UTF-8 text, and
        each split holds a sequence; the directory its shards go to can be written when they must be made), or the
        prepared shards (manifest, headers, sizes, opened by memmap; each split holds a sequence)."""
        if self.text_file is None:
            self.setup()
            for split in SPLITS:
                tokens = [s["tokens"] for s in Manifest.load(self.data_dir).shards if s["split"] == split]
                self.check_split(split, tokens, f"the shards in {self.data_dir}")
            return
        manifest = current_manifest(self.text_file, self.data_dir, self.val_fraction, self.tokenizer)
        if manifest is None:
            if not self.text_file.is_file():
                raise MissingFile(f"data.text_file={str(self.text_file)!r} does not exist")
            check_text(self.text_file)
            parts = split_tokens(self.text_file, self.val_fraction, self.tokenizer)
            splits = {split: [len(part)] for split, part in zip(SPLITS, parts)}
            if not writable(self.data_dir):
                raise SettingError(
                    f"data.data_dir={self.data_dir}: the shards of {self.text_file.name} are made there on first use, "
                    "but it cannot be written; give data.data_dir a writable directory"
                )
        else:
            splits = {
                split: [s["tokens"] for s in manifest.shards if s["split"] == split] for split in ("train", "val")
            }
        for split, tokens in splits.items():
            self.check_split(split, tokens, f"data.text_file={self.text_file}")

    def check_split(self, split: str, tokens: list[int], what: str) -> None:
        """A split whose shards hold no window of data.seq_len + 1 tokens is an error naming it and the fix."""
        if sum((n - 1) // self.seq_len for n in tokens) < 1:
            fix = "raise data.val_fraction" if split == "val" and self.text_file is not None else "give more text"
            raise SettingError(
                f"{what}: its {'validation' if split == 'val' else 'training'} split holds "
                f"{plural(sum(tokens), 'token')}, "
                f"fewer than one sequence of data.seq_len + 1 = {self.seq_len + 1}; {fix}, or lower data.seq_len"
            )

    def setup(self, stage: str | None = None) -> None:
        if self.train_windows is None:
            try:
                manifest = Manifest.load(self.data_dir)
            except ShardError as err:
                if self.prepare_command is None or (self.data_dir / "manifest.json").exists():
                    raise
                raise ShardError(f"{err}; prepare it with: {self.prepare_command}") from err
            self.train_windows = Windows(manifest.open(self.data_dir, "train", self.tokenizer), self.seq_len)
            self.val_set = ValWindows(
                Windows(manifest.open(self.data_dir, "val", self.tokenizer), self.seq_len), self.val_windows
            )

    def samples_seen(self) -> int:
        """Global samples consumed so far: optimizer steps x global batch."""
        trainer = self.trainer
        if trainer is None:
            return 0
        return trainer.global_step * sequences_per_step(self.batch_size, self.global_batch_size, trainer.world_size)

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        start = self.samples_seen()
        if self.resume_samples is not None and self.resume_samples != start:
            raise SettingError(
                f"checkpoint's data position ({self.resume_samples} samples) does not match its step "
                f"({start} samples at the current batch settings); resume with the same data.batch_size, "
                "data.global_batch_size and number of devices"
            )
        stream = TrainStream(self.train_windows, self.seed, self.shuffle, start, rank, world, self.batch_size)
        return DataLoader(
            stream, batch_size=self.batch_size, generator=self.loader_generator(), **self.loader_options()
        )

    def val_dataloader(self) -> DataLoader:
        world = self.trainer.world_size if self.trainer else 1
        padded = ValWindows(self.val_set.windows, self.val_windows, self.batch_size * world)  # whole batches per rank
        return DataLoader(
            padded,
            batch_size=self.batch_size,
            shuffle=False,
            generator=self.loader_generator(),
            **self.loader_options(),
        )

    def loader_options(self) -> dict:
        trainer = self.trainer
        cuda = trainer is not None and trainer.strategy.root_device.type == "cuda"
        options = {"num_workers": self.num_workers, "pin_memory": cuda}
        if self.num_workers:
            options.update(persistent_workers=True, prefetch_factor=4)
        return options

    def loader_generator(self) -> torch.Generator:
        """The loaders' own generator: creating their iterators never draws from the global RNG,
        which would shift the training randomness between an interrupted and a resumed run."""
        return torch.Generator().manual_seed(self.seed)

    def state_dict(self) -> dict:
        return {"samples_seen": self.samples_seen()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.resume_samples = int(state_dict["samples_seen"])


def plural(n: int, noun: str) -> str:
    """ "1 token", "2 tokens"."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")
