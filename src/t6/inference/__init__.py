"""Inference from a checkpoint: text generation."""
