"""The model's configuration: a plain dataclass, free of Hydra.

Hydra composes `size` and `attention` groups; `t6.config.model_config(cfg)` converts
them into this dataclass at the boundary. Everything the backbone needs is here and
every cross-field problem is reported at once, in one ValueError that names the fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    # Mechanism-specific options, validated by the attention class itself
    # (e.g. n_kv_head for GQA, q_rank/k_rank/v_rank for TPA, kv_lora_rank for MLA).
    attention_options: dict[str, Any] = field(default_factory=dict)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        self.attention_options = dict(self.attention_options or {})
        if self.ffn_hidden is None:
            self.ffn_hidden = int(8 * self.d_model / 3)
        problems = []
        for name in ("vocab_size", "block_size", "n_layer", "d_model", "n_head", "head_dim", "ffn_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                problems.append(f"{name}={value!r} must be a positive integer")
        if isinstance(self.head_dim, int) and self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even (RoPE rotates pairs of dimensions)")
        if self.rope_theta <= 0:
            problems.append(f"rope_theta={self.rope_theta} must be positive")
        if not problems:
            # Deferred import: the attention registry imports this module.
            from t6.model.attention import get_attention_class

            try:
                cls = get_attention_class(self.attention)
            except KeyError as err:
                problems.append(str(err.args[0]))
            else:
                problems.extend(cls.check_config(self))
        if problems:
            raise ValueError("Invalid model config:\n  - " + "\n  - ".join(problems))

    def option(self, name: str, default: Any = None) -> Any:
        """A mechanism-specific option, with the mechanism's default."""
        return self.attention_options.get(name, default)
