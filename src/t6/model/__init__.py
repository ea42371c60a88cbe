from t6.model.config import ModelConfig
from t6.model.t6 import T6

__all__ = ["ModelConfig", "T6"]
