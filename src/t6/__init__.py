"""T6 Lab: an experiment platform for attention research (Tensor Product Attention and baselines)."""

__version__ = "0.1.0"
