"""The embedded downstream task `t6_cloze`: a line's last word, in the spirit of LAMBADA.

Each item is a passage (the `context_lines` lines before a line of dialogue, then that line
without its last word) and four candidate words: the true last word and three distractors whose
frequency in the same text is nearest to the true word's. Unigram statistics cannot tell the
candidates apart, so a model beats the 25% of chance only by reading the passage: the metre and
the rhyme, the sentence's grammar, the names and words used a few lines before. Everything
comes from the held-out (validation) part of the corpus; few-shot examples from its first part,
test items from the rest. Scored by `acc` (the candidates are single words of similar length).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np

from t6.evaluation.tasks import held_out_lines, split_pools, write_task

TASK = "t6_cloze"
WORD = re.compile(r"[A-Za-z]+")
NEIGHBOURS = 12  # distractors are drawn from this many words nearest in frequency rank
MIN_WORDS = 3  # the line keeps at least two words of its own before the blank


def is_line(line: str) -> bool:
    """A line of dialogue of at least MIN_WORDS words (not blank, not a speaker tag such as 'ROMEO:')."""
    return len(line.split()) >= MIN_WORDS and not line.rstrip().endswith(":")


def last_word(line: str) -> tuple[str, str] | None:
    """(the line up to its last word, the last word) when the line ends in an alphabetic word
    followed by at most punctuation, else None."""
    match = re.search(r"([A-Za-z]+)[^A-Za-z\s]*\s*$", line)
    if match is None or len(match.group(1)) < 2 or not line[: match.start(1)].strip():
        return None
    prefix = line[: match.start(1)]
    if prefix and not prefix[-1].isspace():  # "o'er", "ne'er-do-well": not a whole word
        return None
    return prefix.rstrip(), match.group(1)


def distractors(word: str, ranked: list[str], rank: dict[str, int], rng, n: int = 3) -> list[str]:
    """n words nearest to `word` in frequency rank (drawn among the NEIGHBOURS nearest), in its case."""
    i = rank[word.lower()]
    near = [w for w in ranked[max(0, i - NEIGHBOURS) : i + NEIGHBOURS + 1] if w != word.lower()]
    near.sort(key=lambda w: abs(rank[w] - i))
    picked = rng.choice(near[:NEIGHBOURS], size=n, replace=False)
    return [w.capitalize() if word[0].isupper() else w for w in picked]


def build_cloze_task(
    out_dir: str | Path,
    text_file: str | Path | None = None,
    val_fraction: float | None = None,
    n_test: int = 1600,
    n_fewshot: int = 20,
    context_lines: int = 3,
    seed: int = 0,
) -> Path:
    """Write test.jsonl, fewshot.jsonl and t6_cloze.yaml into out_dir; returns out_dir (an include_path)."""
    lines = held_out_lines(text_file, val_fraction, TASK)
    text = "\n".join(lines)
    counts = Counter(w.lower() for w in WORD.findall(text))
    ranked = [w for w, _ in counts.most_common()]
    rank = {w: i for i, w in enumerate(ranked)}
    usable = [i for i, ln in enumerate(lines) if i >= context_lines and is_line(ln) and last_word(ln)]
    few_pool, test_pool = split_pools(lines, usable, context_lines, n_test, n_fewshot, TASK)
    rng = np.random.default_rng(seed)

    def items(targets: list[int]) -> list[dict]:
        out = []
        for i in sorted(targets):
            prefix, word = last_word(lines[i])
            context = [ln for ln in lines[:i] if ln.strip()][-context_lines:]
            wrong = distractors(word, ranked, rank, rng)
            label = int(rng.integers(4))
            out.append(
                {
                    "passage": "\n".join([*context, prefix]),
                    "choices": wrong[:label] + [word] + wrong[label:],
                    "label": label,
                }
            )
        return out

    splits = {
        "test": items(rng.choice(test_pool, size=n_test, replace=False).tolist()),
        "fewshot": items(rng.choice(few_pool, size=n_fewshot, replace=False).tolist()),
    }
    return write_task(out_dir, TASK, splits, target_delimiter=" ", builder=__name__)
