"""The embedded cloze task: well-formed, held-out, and not solvable by frequency or length alone."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from t6.data.corpus import TINY_SHAKESPEARE, held_out_text
from t6.data.tokenizer import gpt2_encoding
from t6.evaluation.cloze import TASK, WORD, build_cloze_task, last_word
from t6.evaluation.runner import EvalSpec, resolve_tasks, run_harness
from t6.model import T6

from conftest import random_model


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    return build_cloze_task(tmp_path_factory.mktemp("cloze"))


def items(task_dir, split="test"):
    return [json.loads(x) for x in (task_dir / f"{split}.jsonl").read_text().splitlines()]


def test_items_are_well_formed_held_out_and_deterministic(task_dir, tmp_path):
    test, few = items(task_dir), items(task_dir, "fewshot")
    assert len(test) == 1600 and len(few) == 20
    held_out = held_out_text(TINY_SHAKESPEARE, 0.1)
    for it in test + few:
        answer = it["choices"][it["label"]]
        assert len(set(it["choices"])) == 4 and all(WORD.fullmatch(c) for c in it["choices"])
        last_line = it["passage"].split("\n")[-1]
        assert f"{last_line} {answer}" in held_out  # the passage ends where the answer's line was cut
    assert {it["passage"] for it in test}.isdisjoint(it["passage"] for it in few)
    assert (build_cloze_task(tmp_path / "again") / "test.jsonl").read_text() == (task_dir / "test.jsonl").read_text()
    labels = Counter(it["label"] for it in test)
    assert min(labels.values()) > 300  # the answer's position carries no information


@pytest.mark.parametrize(
    "line,expected",
    [
        ("I hold you a penny,", ("I hold you a", "penny")),
        ("Nay, by Saint Jamy!", ("Nay, by Saint", "Jamy")),
        ("and so it is o'er", None),  # an apostrophe word is not cut
        ("Go, a", None),  # a one-letter word is not an item
        ("Farewell", None),  # nothing before the blank
    ],
)
def test_last_word(line, expected):
    assert last_word(line) == expected


def accuracy(test, score) -> float:
    """Accuracy of choosing the candidate with the highest score(word)."""
    return sum(max(range(4), key=lambda k: score(it["choices"][k])) == it["label"] for it in test) / len(test)


def test_neither_training_frequency_nor_length_solves_it(task_dir):
    """Strategies without the passage stay within 3 standard errors of chance (0.25 +- 0.033 at 1600 items)."""
    test = items(task_dir)
    text = TINY_SHAKESPEARE.read_text(encoding="utf-8")
    train_counts = Counter(w.lower() for w in WORD.findall(text[: int(len(text) * 0.9)]))
    enc = gpt2_encoding()
    bound = 0.25 + 3 * math.sqrt(0.25 * 0.75 / len(test))
    assert accuracy(test, lambda w: train_counts[w.lower()]) < bound  # the most frequent word in training
    assert accuracy(test, lambda w: -len(enc.encode_ordinary(" " + w))) < bound  # the fewest tokens
    assert accuracy(test, lambda w: -len(w)) < bound  # the shortest word


@pytest.mark.slow  # a fresh model over 400 items x 4 choices
def test_fresh_model_is_at_chance(task_dir, tmp_path):
    torch.manual_seed(0)
    fresh = T6(random_model(tmp_path).cfg)  # the real initialization, untrained
    spec = EvalSpec(tasks=[TASK], num_fewshot=[0], limit=400, metrics={TASK: "acc"}, include_path=[str(task_dir)])
    acc = run_harness(fresh, spec, resolve_tasks(spec))[0]["results"][TASK]["acc,none"]
    assert abs(acc - 0.25) < 3 * math.sqrt(0.25 * 0.75 / 400), acc
