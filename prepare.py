"""Prepare token shards: `python prepare.py dataset=fineweb_edu` (see conf/prepare.yaml, conf/dataset/)."""

import os
from pathlib import Path

os.environ.setdefault("T6_ROOT", str(Path(__file__).resolve().parent))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from t6.run.cli import entry, register, user_errors  # noqa: E402


@hydra.main(version_base="1.3", config_path="conf", config_name="prepare")
def main(cfg: DictConfig) -> None:
    from t6.data.prepare import prepare_dataset
    from t6.data.tokenizer import load_tokenizer

    d = cfg.dataset
    with user_errors():  # missing files, a field the rows do not have, another data set in out_dir
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


if __name__ == "__main__":
    register()  # t6's resolvers and each mechanism's options, before Hydra composes
    entry(main)  # a mistake in the config, on the command line or in a file: one message, exit 2
