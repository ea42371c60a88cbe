"""Library messages that say nothing about a T6 run, dropped one by one at the logger that emits
them (a filter on exact message beginnings, never a whole logger, level or warning class):

- Lightning: the LitLogger advertisement; "Trainer already configured with model summary callbacks"
  (conf/callbacks/default.yaml chooses the rich summary on purpose); "`Trainer(limit_val_batches=1.0)`
  was configured" (the config states Lightning's default explicitly);
- lm-eval: "Overwriting default num_fewshot" (the eval group sets num_fewshot on purpose);
- torch: the `LeafSpec` deprecation that Lightning 2.6's own `_pytree` triggers on every run.

And `quiet_progress_bars`: where stderr is not a terminal (nohup, SLURM logs, CI), no tqdm progress bar
(lm-eval draws several per evaluation), each redrawn line of which would stay in the log file.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

DROPPED = {
    "lightning.pytorch.utilities.rank_zero": (
        "💡 Tip: For seamless cloud logging",
        "Trainer already configured with model summary callbacks",
        "`Trainer(limit_val_batches=1.0)` was configured",
    ),
    "lightning.fabric.utilities.rank_zero": ("💡 Tip: For seamless cloud logging",),
    "lm_eval.evaluator": ("Overwriting default num_fewshot of",),
}


class DropMessages(logging.Filter):
    def __init__(self, beginnings: tuple[str, ...]):
        super().__init__()
        self.beginnings = beginnings

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.beginnings)


def quiet_libraries() -> None:
    """Install the filters (idempotent)."""
    for name, beginnings in DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in logger.filters):
            logger.addFilter(DropMessages(beginnings))
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", module="lightning")


def quiet_progress_bars() -> None:
    """Where stderr is not a terminal, disable every tqdm bar of the process (TQDM_DISABLE, which tqdm reads
    when it is imported: call this first). A TQDM_DISABLE already set is kept."""
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")
