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

from pathlib import Path

import numpy as np

from t6.evaluation.tasks import draw_targets, held_out_lines, split_pools, write_task

TASK = "t6_next_line"
MIN_WORDS = 5  # target lines have at least this many words, so three distinct reorderings exist


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


def speech_pools(lines: list[str], context_lines: int, n_test: int, n_fewshot: int, task: str):
    """(few-shot pool, test pool) of the lines of dialogue (`is_speech`) with a passage before them (split_pools)."""
    speech = [i for i, ln in enumerate(lines) if is_speech(ln) and i >= context_lines]
    return split_pools(lines, speech, context_lines, n_test, n_fewshot, task)


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
    val_fraction: float | None = None,
    n_test: int = 100,
    n_fewshot: int = 20,
    context_lines: int = 3,
    seed: int = 0,
) -> Path:
    """Write test.jsonl, fewshot.jsonl and t6_next_line.yaml into out_dir; returns out_dir (an include_path)."""
    lines = held_out_lines(text_file, val_fraction, TASK)
    few_pool, test_pool = speech_pools(lines, context_lines, n_test, n_fewshot, TASK)
    rng = np.random.default_rng(seed)
    test_targets, few_targets = draw_targets(test_pool, few_pool, n_test, n_fewshot, rng)
    splits = {
        "test": make_items(lines, test_targets, context_lines, rng),
        "fewshot": make_items(lines, few_targets, context_lines, rng),
    }
    return write_task(out_dir, TASK, splits, target_delimiter="\n", builder=__name__)
