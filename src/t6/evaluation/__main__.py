"""`python -m t6.evaluation ARGS`: lm-eval's own command line with the `t6` model registered.

lm-eval 0.4.13 discovers models only through its built-in table (no entry points), so
`lm_eval --model t6` works only where t6.evaluation.adapter has been imported; this is that:

    python -m t6.evaluation --model t6 --model_args checkpoint=PATH --tasks t6_next_line

The project's local tasks (t6_next_line, t6_cloze) named in --tasks are built under
data/eval/ and that folder is added with `--include_path` when no include path is given, and
`--batch_size` defaults to the adapter's 16 (lm-eval's own default is 1). pyproject.toml also
declares `t6` under the `lm_eval.models` entry points, for lm-eval versions that read them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEFAULT_BATCH_SIZE = "16"


def _given(argv: list[str], *flags: str) -> bool:
    return any(a in flags or a.startswith(tuple(f + "=" for f in flags)) for a in argv)


def _value(argv: list[str], flag: str) -> str:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return ""


def cli_args(argv: list[str], root: Path) -> list[str]:
    """lm-eval's arguments with the project's defaults added: the local tasks' folder (each named task
    built under root/data/eval/<task>/, as training builds it) when --tasks names one, and --batch_size 16."""
    from t6.evaluation import cloze, next_line

    builders = {next_line.TASK: next_line.build_next_line_task, cloze.TASK: cloze.build_cloze_task}
    argv = list(argv)
    named = [t for t in _value(argv, "--tasks").split(",") if t in builders]
    if named and not _given(argv, "--include_path"):
        for task in named:
            builders[task](root / "data" / "eval" / task)
        argv += ["--include_path", str(root / "data" / "eval")]  # lm-eval finds each task's YAML below it
    if not _given(argv, "--batch_size", "-b"):
        argv += ["--batch_size", DEFAULT_BATCH_SIZE]
    return argv


if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    import t6.evaluation.adapter  # noqa: F401  (registers the model "t6")

    sys.argv[1:] = cli_args(sys.argv[1:], Path(os.environ.get("T6_ROOT", ".")).resolve())
    cli_evaluate()
