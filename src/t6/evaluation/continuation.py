"""The embedded downstream task `t6_continuation`, built from the held-out part of a text corpus.

Each item is a passage of `context_lines` consecutive lines and four candidate next lines: the true one and three
other lines of dialogue of the same held-out text with as many words, taken from elsewhere in it (never from the
passage, nor from the `context_lines` lines after the target). Every candidate is a real line, fluent and of the
same length, so grammar and length do not decide (unlike `t6_next_line`, whose distractors are reorderings of the
true line's words): only the passage does, through its speaker, its rhyme and metre, its names and its argument. A
model that reads no context is at the 25% of chance; a strong small model (SmolLM2-135M) is well above it and well
below the ceiling. Few-shot examples come from the first part of the held-out text, test items and their
distractors from the rest. Scored by `acc_norm` (log-likelihood per byte: the candidates are the same number of
words, not of characters).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from t6.evaluation.next_line import speech_pools
from t6.evaluation.tasks import draw_targets, held_out_lines, write_task

TASK = "t6_continuation"


def make_items(lines: list[str], targets: list[int], pool: list[int], context_lines: int, rng) -> list[dict]:
    """Items for the target line indices, distractors drawn from `pool` (line indices) among lines of the same
    number of words, away from the target's passage."""
    by_length: dict[int, list[int]] = defaultdict(list)
    for i in pool:
        by_length[len(lines[i].split())].append(i)
    items = []
    for i in targets:
        n, text = len(lines[i].split()), " ".join(lines[i].split())
        shown = [j for j in range(i) if lines[j].strip()][-context_lines:]  # the passage's lines (blank ones skipped)
        near = range(shown[0], i + context_lines + 1)  # the passage, the target and the lines just after it
        same = [j for j in by_length[n] if j not in near and " ".join(lines[j].split()) != text]
        distractors = [" ".join(lines[j].split()) for j in rng.choice(same, size=3, replace=False)]
        label = int(rng.integers(4))
        choices = distractors[:label] + [text] + distractors[label:]
        items.append({"passage": "\n".join(lines[j] for j in shown), "choices": choices, "label": label})
    return items


def build_continuation_task(
    out_dir: str | Path,
    text_file: str | Path | None = None,
    val_fraction: float | None = None,
    n_test: int = 400,
    n_fewshot: int = 20,
    context_lines: int = 3,
    seed: int = 0,
) -> Path:
    """Write test.jsonl, fewshot.jsonl and t6_continuation.yaml into out_dir; returns out_dir (an include_path)."""
    lines = held_out_lines(text_file, val_fraction, TASK)
    few_pool, test_pool = speech_pools(lines, context_lines, n_test, n_fewshot, TASK)
    rng = np.random.default_rng(seed)
    test_targets, few_targets = draw_targets(
        with_company(lines, test_pool), with_company(lines, few_pool), n_test, n_fewshot, rng
    )
    splits = {
        "test": make_items(lines, test_targets, test_pool, context_lines, rng),
        "fewshot": make_items(lines, few_targets, few_pool, context_lines, rng),
    }
    return write_task(out_dir, TASK, splits, target_delimiter="\n", builder=__name__)


def with_company(lines: list[str], pool: list[int], least: int = 8) -> list[int]:
    """The lines of the pool that have at least `least` lines of their number of words in it (three distractors,
    away from the passage, for each)."""
    counts = Counter(len(lines[i].split()) for i in pool)
    return [i for i in pool if counts[len(lines[i].split())] >= least]
