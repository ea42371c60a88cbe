"""The embedded downstream task `t6_next_line`, built from the held-out part of a text corpus.

Each item is a passage of `context_lines` consecutive lines and four candidate next lines:
the true one and three distractors made of the same words in another (seeded) order. The
candidates have the same words and length, so neither word frequencies nor length decide:
a model must have learned how the language is ordered to beat the 25% of chance, which even
a briefly trained tiny model does, while an untrained one does not. Few-shot examples come
from the first part of the held-out text, test items from the rest.

The task is written as JSONL plus an lm-eval task YAML with absolute paths, loaded with
`TaskManager(include_path=out_dir, include_defaults=False)`; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from t6.data.corpus import TINY_SHAKESPEARE
from t6.data.tokenizer import EOT, gpt2_encoding

TASK = "t6_next_line"
MIN_WORDS = 5  # target lines have at least this many words, so three distinct reorderings exist


def held_out_text(text_file: Path, val_fraction: float) -> str:
    """The validation part of the corpus as `prepare_text_corpus` splits it (the last val_fraction
    of the tokens), starting at the first full line."""
    enc = gpt2_encoding()
    tokens = [EOT, *enc.encode_ordinary(Path(text_file).read_text(encoding="utf-8"))]
    n_val = int(len(tokens) * val_fraction)
    text = enc.decode(tokens[len(tokens) - n_val :])
    return text[text.index("\n") + 1 :]


def is_speech(line: str) -> bool:
    """A line of dialogue of at least MIN_WORDS words (not blank, not a speaker tag such as 'ROMEO:')."""
    return len(line.split()) >= MIN_WORDS and not line.rstrip().endswith(":")


def reorderings(line: str, rng, n: int = 3) -> list[str]:
    """n distinct orderings of the line's words, all different from the line itself."""
    words, out = line.split(), []
    seen = {" ".join(words)}
    while len(out) < n:
        candidate = " ".join(words[k] for k in rng.permutation(len(words)))
        if candidate not in seen:
            seen.add(candidate)
            out.append(candidate)
    return out


def make_items(lines: list[str], targets: list[int], context_lines: int, rng) -> list[dict]:
    items = []
    for i in targets:
        context = [ln for ln in lines[:i] if ln.strip()][-context_lines:]
        distractors = reorderings(lines[i], rng)
        label = int(rng.integers(4))
        choices = distractors[:label] + [" ".join(lines[i].split())] + distractors[label:]
        items.append({"passage": "\n".join(context), "choices": choices, "label": label})
    return items


def build_next_line_task(
    out_dir: str | Path,
    text_file: str | Path | None = None,
    val_fraction: float = 0.1,
    n_test: int = 100,
    n_fewshot: int = 20,
    context_lines: int = 3,
    seed: int = 0,
) -> Path:
    """Write test.jsonl, fewshot.jsonl and t6_next_line.yaml into out_dir; returns out_dir (an include_path)."""
    lines = held_out_lines(text_file, val_fraction, TASK)
    speech = [i for i, ln in enumerate(lines) if is_speech(ln) and i >= context_lines]
    few_pool, test_pool = split_pools(lines, speech, context_lines, n_test, n_fewshot, TASK)
    rng = np.random.default_rng(seed)
    test_targets = sorted(rng.choice(test_pool, size=n_test, replace=False).tolist())
    few_targets = sorted(rng.choice(few_pool, size=n_fewshot, replace=False).tolist())
    splits = {
        "test": make_items(lines, test_targets, context_lines, rng),
        "fewshot": make_items(lines, few_targets, context_lines, rng),
    }
    return write_task(out_dir, TASK, splits, target_delimiter="\n", builder=__name__)


def held_out_lines(text_file: str | Path | None, val_fraction: float, task: str) -> list[str]:
    """The held-out lines of text_file (None: the embedded Tiny Shakespeare) for a local task."""
    text_file = Path(text_file) if text_file else TINY_SHAKESPEARE
    if not text_file.is_file():
        raise FileNotFoundError(f"eval.local_tasks.{task}.text_file={str(text_file)!r} does not exist")
    return held_out_text(text_file, val_fraction).split("\n")


def split_pools(lines: list[str], usable: list[int], context_lines: int, n_test: int, n_fewshot: int, task: str):
    """(few-shot pool, test pool) of usable line indices: few-shot examples from the first 15% of the
    held-out lines, test items from the rest, so no test passage holds a few-shot target."""
    cut = int(len(lines) * 0.15)
    few_pool, test_pool = [i for i in usable if i < cut], [i for i in usable if i >= cut + context_lines]
    if len(few_pool) < n_fewshot or len(test_pool) < n_test:
        raise ValueError(
            f"the held-out text has {len(test_pool)} test and {len(few_pool)} few-shot lines usable for {task}: "
            "too few "
            f"for eval.local_tasks.{task}.n_test={n_test} and n_fewshot={n_fewshot}"
        )
    return few_pool, test_pool


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
