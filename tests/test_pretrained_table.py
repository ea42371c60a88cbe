"""experiments/pretrained's tables (t6.report.experiments.pretrained_table): each task on its own."""

from __future__ import annotations


def test_the_pretrained_study_gives_each_task_its_kept_share_and_standard_error():
    """experiments/pretrained: a task the source scores at chance has no share to keep (no division by zero); the
    others give (acc - 0.25) / (source - 0.25) ± sqrt(acc (1 - acc) / n) / (source - 0.25)."""
    from t6.report.experiments import task_cell

    source = {"eval/0shot/t6_cloze/acc": 0.75, "eval/0shot/t6_continuation/acc_norm": 0.25}
    ours = {"eval/0shot/t6_cloze/acc": 0.5, "eval/0shot/t6_continuation/acc_norm": 0.5}
    assert task_cell(ours, source, "t6_cloze", "acc", 0, 100) == "0.500 (50% ± 10%)"
    assert task_cell(ours, source, "t6_continuation", "acc_norm", 0, 100) == "0.500 (source at chance)"
    assert task_cell({}, source, "t6_cloze", "acc", 0, 100) == "-"
