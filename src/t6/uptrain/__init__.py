"""Uptraining (Ainslie et al. 2023, "GQA", §2.1, and its successors MHA2MLA, TransMLA): a model's attention
converted into another mechanism, then trained as a warm start.

    t6.uptrain.convert      the conversion and the warm-start checkpoint format (python convert.py)
    t6.uptrain.closed_form  closed-form starts from a grouped-query source (GQA/MQA, MLA, TPA)
    t6.uptrain.distill      calibration statistics and layer-wise attention-output distillation (any mechanism)
    t6.uptrain.job          convert.py's run: calibration text, the checkpoint, the MLflow runs
    t6.uptrain.recipe       the uptrain recipe's config: step count and learning rate from the source,
                            the converted model's shape written into the run's config (python train.py)
"""
