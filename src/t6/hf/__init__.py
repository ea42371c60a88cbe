"""Hugging Face export: a T6 checkpoint as a model directory that transformers, lm-eval's `hf` model and
the Hub load (export.py), and back (t6.model.load reads such a directory)."""
