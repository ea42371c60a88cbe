"""Downstream evaluation with lm-evaluation-harness: the `t6` model adapter, the embedded
next-line task, the training callback and checkpoint evaluation (`python eval.py`)."""
