"""Uptraining (Ainslie et al. 2023, "GQA", §2.1): an MHA checkpoint converted to GQA or MQA, then
trained on a fraction of its source's tokens as a warm start.

    t6.uptrain.convert  pooling K/V heads, the warm-start checkpoint format (python convert.py)
    t6.uptrain.recipe   the uptrain recipe's config: step count and learning rate from the source,
                        the converted model's shape written into the run's config (python train.py)
"""
