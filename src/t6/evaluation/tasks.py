"""What the local evaluation tasks share: their held-out text, the split of it into few-shot and test
pools, and the files an lm-eval task is read from (JSONL splits and a task YAML with absolute paths)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from t6.data.corpus import TINY_SHAKESPEARE, held_out_text
from t6.errors import MissingFile, SettingError


def held_out_lines(text_file: str | Path | None, val_fraction: float | None, task: str) -> list[str]:
    """The held-out lines of text_file (None: the embedded Tiny Shakespeare) for a local task."""
    text_file = Path(text_file) if text_file else TINY_SHAKESPEARE
    if not text_file.is_file():
        raise MissingFile(f"eval.local_tasks.{task}.text_file={str(text_file)!r} does not exist")
    return held_out_text(text_file, val_fraction).split("\n")


def split_pools(lines: list[str], usable: list[int], context_lines: int, n_test: int, n_fewshot: int, task: str):
    """(few-shot pool, test pool) of usable line indices: few-shot examples from the first 15% of the
    held-out lines, test items from the rest, so no test passage holds a few-shot target."""
    cut = int(len(lines) * 0.15)
    few_pool, test_pool = [i for i in usable if i < cut], [i for i in usable if i >= cut + context_lines]
    if len(few_pool) < n_fewshot or len(test_pool) < n_test:
        raise SettingError(
            f"the held-out text has {len(test_pool)} test and {len(few_pool)} few-shot lines usable for {task}: "
            "too few "
            f"for eval.local_tasks.{task}.n_test={n_test} and n_fewshot={n_fewshot}"
        )
    return few_pool, test_pool


def draw_targets(test_pool: list[int], few_pool: list[int], n_test: int, n_fewshot: int, rng):
    """(test targets, few-shot targets): line indices drawn without replacement from each pool, test first, each
    sorted."""
    test = sorted(rng.choice(test_pool, size=n_test, replace=False).tolist())
    few = sorted(rng.choice(few_pool, size=n_fewshot, replace=False).tolist())
    return test, few


def write_task(
    out_dir: str | Path, task: str, splits: dict[str, list[dict]], target_delimiter: str, builder: str
) -> Path:
    """Write each split as <split>.jsonl and the task YAML into out_dir; returns out_dir (an include_path)."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, items in splits.items():
        write_if_changed(out_dir / f"{name}.jsonl", "".join(json.dumps(it) + "\n" for it in items))
    write_if_changed(
        out_dir / f"{task}.yaml", task_yaml(out_dir, task, target_delimiter=target_delimiter, builder=builder)
    )
    return out_dir


def task_yaml(out_dir: Path, task: str, target_delimiter: str, builder: str) -> str:
    """The lm-eval YAML of a local multiple-choice task whose test.jsonl and fewshot.jsonl are in out_dir
    (items {"passage", "choices", "label"}); each choice follows the passage after target_delimiter."""
    return f"""# Built by {builder}; absolute paths, rewritten on every build.
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(out_dir / "test.jsonl"))}
    fewshot: {json.dumps(str(out_dir / "fewshot.jsonl"))}
test_split: test
fewshot_split: fewshot
output_type: multiple_choice
doc_to_text: "{{{{passage}}}}"
doc_to_choice: choices
doc_to_target: label
target_delimiter: {json.dumps(target_delimiter)}
fewshot_delimiter: "\\n\\n"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 2.0
"""


def write_if_changed(path: Path, text: str) -> None:
    """Atomic write, skipped when the content is already there (keeps the datasets cache valid;
    safe when several processes build the same task)."""
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
