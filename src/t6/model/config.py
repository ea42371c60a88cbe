"""The model's configuration: a plain dataclass, free of Hydra.

Hydra composes `size` and `attention` groups; `t6.hydra_config.model_config(cfg)` converts
them into this dataclass at the boundary. Everything the backbone needs is here and
every cross-field problem is reported at once, in one ConfigError (t6.errors) that names the fields.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from t6.errors import ConfigError
from t6.model.attention import Options, get_mechanism

ROPE_REMAP_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_remap_problems(scaling: Any) -> list[str]:
    """What is wrong with a size.rope_remap setting (None, or Llama 3's remap with its four numbers)."""
    if scaling is None:
        return []
    if not isinstance(scaling, dict):
        return [f"size.rope_remap={scaling!r} must be null or a mapping with rope_type: llama3"]
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        return [f"size.rope_remap.rope_type={kind!r}: T6 applies Llama 3's frequency remap (rope_type: llama3) only"]
    problems = [
        f"size.rope_remap.{k}={scaling.get(k)!r} must be a positive number"
        for k in ROPE_REMAP_KEYS
        if not isinstance(scaling.get(k), (int, float)) or isinstance(scaling.get(k), bool) or scaling.get(k) <= 0
    ]
    if not problems and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        problems.append("size.rope_remap.high_freq_factor must be larger than low_freq_factor")
    return problems


@dataclass
class ModelConfig:
    vocab_size: int = 50304  # GPT-2's 50257 tokens padded to a multiple of 64
    block_size: int = 1024  # longest sequence the model is trained on (RoPE table length)
    n_layer: int = 12
    d_model: int = 768
    n_head: int = 12  # query heads h
    head_dim: int = 64  # d_h
    ffn_hidden: int | None = None  # SwiGLU hidden width; None -> floor(8/3 * d_model)
    attention: str = "mha"  # a name registered in t6.model.attention
    # The mechanism's options as plain data (checkpoints stay loadable with weights_only=True);
    # their types, defaults and checks live in the mechanism's `Options` dataclass. Stored
    # complete: every option with its value, defaults and the name's preset filled in.
    attention_options: dict[str, Any] = field(default_factory=dict)
    rope_theta: float = 10000.0
    # None: plain RoPE; or Llama 3's fixed frequency remap (its config.json's rope_scaling):
    # {rope_type: llama3, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}
    # (t6.model.layers.rope_frequencies applies it to every rotary table). Not named rope_scaling:
    # transformers' configs (an export's T6Config) reserve that name.
    rope_remap: dict[str, Any] | None = None
    norm_eps: float = 1e-6
    init_std: float = 0.02
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        problems = []  # named as the config names them: size.<field>, attention.options.<option>
        given = self.attention_options or {}
        if not isinstance(given, dict):
            problems.append(f"attention.options={given!r} must be a mapping of options")
            given = {}
        self.attention_options = dict(given)
        if isinstance(self.rope_remap, dict):  # one spelling, stored as plain data
            self.rope_remap = {"rope_type": self.rope_remap.get("rope_type", self.rope_remap.get("type"))} | {
                k: self.rope_remap[k] for k in ROPE_REMAP_KEYS if k in self.rope_remap
            }
        if self.ffn_hidden is None:
            self.ffn_hidden = int(8 * self.d_model / 3)
        for name in ("vocab_size", "block_size", "n_layer", "d_model", "n_head", "head_dim", "ffn_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"size.{name}={value!r} must be a positive integer")
        if isinstance(self.head_dim, int) and self.head_dim % 2:
            problems.append(f"size.head_dim={self.head_dim} must be even (RoPE rotates pairs of dimensions)")
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                problems.append(f"size.{name}={value!r} must be a positive number")
        if not isinstance(self.tie_embeddings, bool):
            problems.append(f"size.tie_embeddings={self.tie_embeddings!r} must be true or false")
        problems += rope_remap_problems(self.rope_remap)
        try:
            mechanism = get_mechanism(self.attention)
        except KeyError as err:
            problems.append(str(err.args[0]))
        else:
            options, option_problems = mechanism.options(self.attention_options)
            if options is not None:
                # a mechanism's cross-field checks read the sizes, so they run on valid sizes only
                option_problems = options.problems(self) if not problems else Options.problems(options, self)
                self.attention_options = asdict(options)
            problems += option_problems
        if problems:
            raise ConfigError("Invalid model config", problems)

    def options(self):
        """The attention's typed options (its `Options` dataclass)."""
        return get_mechanism(self.attention).cls.Options(**self.attention_options)
