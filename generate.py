"""Generate text from a checkpoint: `python generate.py ckpt_path=... prompt="ROMEO:" max_new_tokens=100`
(see conf/generate.yaml for every setting)."""

import hydra
from omegaconf import DictConfig

from t6.run.cli import entry, register, user_errors


@hydra.main(version_base="1.3", config_path="conf", config_name="generate")
def main(cfg: DictConfig) -> None:
    import torch

    from t6.inference.generate import generate_text, load_for_generation

    with user_errors():  # a setting out of range, a missing or damaged checkpoint, a prompt too long
        model, tokenizer, prompts = load_for_generation(cfg)
    torch.manual_seed(cfg.seed)
    texts = generate_text(
        model, prompts, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, cfg.stop_at_eot, cfg.seed, tokenizer
    )
    for text in texts:
        print(text)
        print("-" * 40)


if __name__ == "__main__":
    register()  # t6's resolvers and each mechanism's options, before Hydra composes
    entry(main)  # a mistake in the config, on the command line or in a file: one message, exit 2
