"""`python -m t6.evaluation ARGS`: lm-eval's own command line with the `t6` model registered.

lm-eval 0.4.13 discovers models only through its built-in table (no entry points), so
`lm_eval --model t6` works only where t6.evaluation.adapter has been imported; this is that:

    python -m t6.evaluation --model t6 --model_args checkpoint=PATH --tasks hellaswag
"""

import t6.evaluation.adapter  # noqa: F401  (registers the model "t6")
from lm_eval.__main__ import cli_evaluate

if __name__ == "__main__":
    cli_evaluate()
