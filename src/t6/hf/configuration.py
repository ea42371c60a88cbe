"""The Hugging Face configuration of an exported T6 (`model_type: t6`).

Its attributes are the fields of t6.model.config.ModelConfig as config.json holds them (the
modeling file builds a ModelConfig from them, with its defaults and checks) and the token ids;
the names other tools read (hidden_size, num_hidden_layers, max_position_embeddings, ...) map
onto those fields. `use_cache` (default true) is whether a forward in eval mode returns its cache,
as transformers' models do. Every export carries this file as configuration_t6.py (t6.hf.export).
"""

from transformers import PretrainedConfig


class T6Config(PretrainedConfig):
    model_type = "t6"
    attribute_map = {
        "hidden_size": "d_model",
        "intermediate_size": "ffn_hidden",
        "max_position_embeddings": "block_size",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
        "tie_word_embeddings": "tie_embeddings",
    }
    use_cache: bool = True
