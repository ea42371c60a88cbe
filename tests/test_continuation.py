"""The embedded continuation task: every candidate a real held-out line of the true line's length, so that only the
passage tells them apart."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from t6.data.corpus import TINY_SHAKESPEARE, held_out_text
from t6.evaluation.continuation import build_continuation_task


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    return build_continuation_task(tmp_path_factory.mktemp("continuation"))


def items(task_dir, split="test"):
    return [json.loads(x) for x in (task_dir / f"{split}.jsonl").read_text().splitlines()]


def test_items_are_real_held_out_lines_of_one_length_and_deterministic(task_dir, tmp_path):
    test, few = items(task_dir), items(task_dir, "fewshot")
    assert len(test) == 400 and len(few) == 20
    spoken = [" ".join(ln.split()) for ln in held_out_text(TINY_SHAKESPEARE, 0.1).split("\n") if ln.strip()]
    follows = {tuple(spoken[k : k + 3]): set() for k in range(len(spoken) - 3)}
    for k in range(len(spoken) - 3):
        follows[tuple(spoken[k : k + 3])].add(spoken[k + 3])  # the line after each three (blank lines skipped)
    for it in test + few:
        answer = it["choices"][it["label"]]
        assert len(set(it["choices"])) == 4 and set(it["choices"]) <= set(spoken)  # four different real lines
        assert len({len(c.split()) for c in it["choices"]}) == 1  # of the true line's number of words
        passage = tuple(" ".join(ln.split()) for ln in it["passage"].split("\n"))
        assert answer in follows[passage]  # the true next line of the passage
        assert not set(it["choices"]) - {answer} & set(passage)  # no distractor from the passage itself
    assert {it["passage"] for it in test}.isdisjoint(it["passage"] for it in few)
    assert (build_continuation_task(tmp_path / "again") / "test.jsonl").read_text() == (
        task_dir / "test.jsonl"
    ).read_text()
    labels = Counter(it["label"] for it in test)
    assert min(labels.values()) > 70  # the answer's position carries no information


def test_length_and_frequency_cannot_pick_the_answer(task_dir):
    """Without the passage a choice is at chance: the longest candidate, or the one of the most common words, is
    the answer about a quarter of the time."""
    test = items(task_dir)
    words = Counter(w.lower() for it in test for c in it["choices"] for w in c.split())

    def accuracy(score) -> float:
        return sum(max(range(4), key=lambda k: score(it["choices"][k])) == it["label"] for it in test) / len(test)

    assert 0.18 < accuracy(len) < 0.32
    assert 0.18 < accuracy(lambda c: sum(words[w.lower()] for w in c.split()) / len(c.split())) < 0.32
