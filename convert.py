"""Convert an MHA checkpoint into GQA or MQA for uptraining:
`python convert.py ckpt_path=MHA.ckpt target=gqa target_kv_heads=2 out=gqa2.ckpt` (see conf/convert.yaml)."""

import hydra
from omegaconf import DictConfig

from t6.run.cli import entry, register
from t6.uptrain.convert import convert_checkpoint


@hydra.main(version_base="1.3", config_path="conf", config_name="convert")
def main(cfg: DictConfig) -> None:
    ckpt = convert_checkpoint(cfg.ckpt_path, cfg.target, cfg.target_kv_heads, cfg.method, cfg.out)
    conv, src = ckpt["conversion"], ckpt["source"]
    print(
        f"wrote {cfg.out}: {src['attention']} (h={src['n_head']}) -> {conv['target']} "
        f"with {conv['kv_heads']} KV head{'s' if conv['kv_heads'] > 1 else ''} "
        f"({conv['method']}); source run {src['mlflow_run_id']}, {src['tokens']} tokens in {src['steps']} steps\n"
        f"uptrain with: python train.py experiment=uptrain init_from={cfg.out} uptrain_fraction=0.05"
    )


if __name__ == "__main__":
    register()  # t6's resolvers and each mechanism's options, before Hydra composes
    entry(main)  # a mistake in the config or on the command line: one message, exit 2
