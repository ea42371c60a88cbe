"""Text generation from a checkpoint: load the model and the tokenizer it records (GPT-2 BPE unless it
records another), encode the prompts, decode with the KV caches, return the texts. `main` is what
`python generate.py` runs."""

from __future__ import annotations

import torch
from omegaconf import DictConfig, OmegaConf

from t6.data.tokenizer import Tokenizer, gpt2, load_with_tokenizer
from t6.errors import SettingError
from t6.hardware.device import choose_device
from t6.model import T6
from t6.model.t6 import check_sampling, left_pad


def generate_text(
    model: T6,
    prompts: list[str],
    max_new_tokens: int = 100,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_at_eot: bool = True,
    seed: int | None = None,
    tokenizer: Tokenizer | None = None,
) -> list[str]:
    """Each prompt followed by its continuation (up to the tokenizer's end of text when stop_at_eot);
    prompts of different lengths go in one left-padded batch. An empty prompt starts from end of text.
    tokenizer: the model's (default GPT-2 BPE)."""
    enc = tokenizer or gpt2()
    eot = enc.eot
    tokens = [enc.encode_special(p) or [eot] for p in prompts]
    idx, mask = left_pad(tokens, pad_id=eot)
    device = model.embed.weight.device
    generator = None if seed is None else torch.Generator(device).manual_seed(seed)
    out = model.generate(
        idx.to(device),
        max_new_tokens,
        temperature,
        top_k,
        top_p,
        stop_tokens=(eot,) if stop_at_eot else (),
        generator=generator,
        prompt_mask=mask.to(device),
    )
    texts = []
    for row, prompt in zip(out[:, idx.shape[1] :].tolist(), tokens):
        if stop_at_eot and eot in row:
            row = row[: row.index(eot)]
        texts.append(enc.decode(prompt + row))
    return texts


def generation_device(device: str) -> str:
    """`device=auto`: a CUDA GPU when there is one, else the CPU; `cuda[:N]` without CUDA is an error."""
    chosen = choose_device(device)[0]
    if chosen.startswith("cuda") and not torch.cuda.is_available():
        raise SettingError(f"device={device}: this machine has no CUDA GPU; use device=cpu (or device=auto)")
    return chosen


def load_for_generation(cfg: DictConfig) -> tuple[T6, Tokenizer, list[str]]:
    """The checks of the `generate` config (conf/generate.yaml) and the model it names: the settings' signs and
    ranges, the checkpoint (read, damaged or missing: named), the prompts against the model's context; every
    problem an error naming its field and the fix, before anything is generated. Returns (model, its tokenizer,
    prompts)."""
    if OmegaConf.is_missing(cfg, "ckpt_path") or not cfg.ckpt_path:
        raise SettingError("ckpt_path is required: python generate.py ckpt_path=/path/to/last.ckpt prompt='ROMEO:'")
    new = cfg.max_new_tokens
    if not isinstance(new, int) or isinstance(new, bool) or new < 1:
        raise SettingError(f"max_new_tokens={new!r} must be a positive number of tokens, e.g. max_new_tokens=100")
    check_sampling(cfg.temperature, cfg.top_k, cfg.top_p)
    prompts = [str(p) for p in (cfg.prompt if OmegaConf.is_list(cfg.prompt) else [cfg.prompt])]
    if not prompts:
        raise SettingError("prompt=[] gives nothing to continue; give a text (prompt=ROMEO:) or a list of them")
    model, tokenizer = load_with_tokenizer(cfg.ckpt_path, device=generation_device(cfg.device))
    block = model.cfg.block_size
    longest = max(len(tokenizer.encode_special(p) or [tokenizer.eot]) for p in prompts)
    if longest + new > block:
        raise SettingError(
            f"prompt ({longest} tokens) + max_new_tokens={new} exceeds the model's context of {block} tokens "
            f"(size.block_size); set max_new_tokens<={block - longest} or shorten the prompt"
        )
    return model, tokenizer, prompts


def main(cfg: DictConfig) -> list[str]:
    """generate.py: generate as conf/generate.yaml says and print each text; returns the texts."""
    model, tokenizer, prompts = load_for_generation(cfg)
    torch.manual_seed(cfg.seed)
    texts = generate_text(
        model,
        prompts,
        cfg.max_new_tokens,
        cfg.temperature,
        cfg.top_k,
        cfg.top_p,
        cfg.stop_at_eot,
        cfg.seed,
        tokenizer,
    )
    for text in texts:
        print(text)
        print("-" * 40)
    return texts
