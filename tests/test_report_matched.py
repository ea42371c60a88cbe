"""report.py on a matched comparison (t6.report.matched): synthetic runs logged into a real MLflow store, read back
as report.py reads them; every number of the per-criterion tables against scipy, the figure's Pareto front."""

from __future__ import annotations

import math
import statistics

import mlflow
import pytest
from mlflow.entities import Metric, Param
from scipy import stats

from t6.report import build_report, find_runs, load_runs
from t6.report.matched import confidence_interval, pareto_front

# (mechanism, gate, criterion) -> (heads, KV bytes/token, params, the three seeds' validation losses)
RUNS = {
    ("mha", "none", "params"): (4, 4096, 7.49e6, [6.40, 6.30, 6.35]),
    ("tpa", "none", "params"): (5, 2208, 7.48e6, [5.90, 5.95, 5.92]),
    ("mqa", "none", "params"): (7, 1024, 7.49e6, [6.35, 6.45, 6.25]),
    ("mha", "elementwise", "params"): (3, 3072, 7.46e6, [6.20, 6.22, 6.21]),
    ("mha", "none", "kv_bytes"): (4, 4096, 7.49e6, [6.40, 6.30, 6.35]),
    ("tpa", "none", "kv_bytes"): (9, 4088, 7.74e6, [6.38, 6.33, 6.31]),
    ("mqa", "none", "kv_bytes"): (7, 1024, 7.49e6, [6.35, 6.45, 6.25]),
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("matched")
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.create_experiment("matched", artifact_location=(root / "artifacts").as_uri())
    for (name, gate, criterion), (heads, kv, params, losses) in RUNS.items():
        for seed, loss in enumerate(losses, 1):
            run = client.create_run(experiment, run_name=f"{name}-{gate}-{criterion}-seed{seed}").info.run_id
            values = {"attention.name": name, "attention.options.output_gate": gate, "match.name": criterion}
            values |= {"seed": seed, "size.n_head": heads, "match/heads": heads, "match/kv_bytes": kv}
            values |= {"match/params": params, "model/kv_cache_bytes_per_token": kv, "model/params": params}
            client.log_batch(
                run,
                params=[Param(k, str(v)) for k, v in values.items()],
                metrics=[Metric("val/loss", loss, 0, 99)],
            )
            client.set_terminated(run)
    runs, _, _ = find_runs(client, "matched")
    return build_report(load_runs(client, runs), root / "out", "matched").markdown, root / "out"


def table_rows(markdown: str, criterion: str) -> dict[str, list[str]]:
    """{row label: its cells after the label} of the table under `### match=<criterion>`."""
    section = markdown.split(f"### match={criterion}\n")[1].strip().split("\n\n")[0]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()[2:]]
    return {row[0]: row[1:] for row in cells}


@pytest.mark.parametrize("criterion", ["params", "kv_bytes"])
def test_one_table_per_criterion_with_the_ci_and_welchs_test_against_mha(report, criterion):
    markdown, _ = report
    rows = table_rows(markdown, criterion)
    expected = {(n if g == "none" else f"{n}+gate"): v for (n, g, c), v in RUNS.items() if c == criterion}
    assert list(rows) == [label for label in ("mha", "mha+gate", "mqa", "tpa") if label in expected]  # paper order
    mha = expected["mha"][3]
    for label, (heads, kv, params, losses) in expected.items():
        cells = rows[label]
        mean, half = statistics.fmean(losses), stats.t.ppf(0.975, 2) * statistics.stdev(losses) / math.sqrt(3)
        low, high = stats.t.interval(0.95, 2, loc=mean, scale=stats.sem(losses))
        assert half == pytest.approx((high - low) / 2)
        assert cells[:5] == [f"{params / 1e6:.2f}M", str(heads), f"{kv:,}", "3", f"{mean:.4f} ± {half:.4f}"]
        if label != "mha":
            p = stats.ttest_ind(losses, mha, equal_var=False).pvalue
            delta, shown = f"{mean - statistics.fmean(mha):+.4f}", f"{p:.3f}"
            assert cells[5:] == ([f"**{delta}**", f"**{shown}**"] if p < 0.05 else [delta, shown])


def test_the_report_names_every_difference_and_the_pareto_front(report):
    markdown, out = report
    significant = markdown.split("Significant (p < 0.05): ")[1].split("\n")[0]
    not_significant = markdown.split("Not significant: ")[1].split("\n")[0]
    assert "tpa under params" in significant and "mha+gate under params" in significant
    assert "mqa under params" in not_significant and "tpa under kv_bytes" in not_significant
    front = markdown.split("Pareto front (no row has both less cache and a lower loss): ")[1].split("\n")[0]
    # mqa: the least cache (the same model under both criteria: both points); tpa (params): the lowest loss; every
    # other row has a point that beats it on both
    names = [part.split(" at ")[0] for part in front.rstrip(".").split("; ")]
    assert names == ["mqa (kv_bytes)", "mqa (params)", "tpa (params)"]
    assert (out / "val_loss_vs_kv.png").stat().st_size > 10_000


def test_pareto_front_and_confidence_interval():
    points = [(1, 5.0, "a"), (2, 4.0, "b"), (2, 4.5, "c"), (3, 4.0, "d"), (4, 3.0, "e"), (1, 5.0, "f")]
    assert pareto_front(points) == [(1, 5.0, "a"), (1, 5.0, "f"), (2, 4.0, "b"), (4, 3.0, "e")]
    assert confidence_interval([1.0]) is None
    assert confidence_interval([1.0, 3.0]) == pytest.approx(stats.t.ppf(0.975, 1) * math.sqrt(2) / math.sqrt(2))


def test_runs_of_one_criterion_have_no_matched_section(tmp_path):
    from t6.report import RunData

    runs = [
        RunData(f"r{i}", f"r{i}", "FINISHED", {"attention.name": "mha", "match.name": "params", "seed": str(i)},
                metrics={"val/loss": 6.0 + i})
        for i in range(2)
    ]  # fmt: skip
    assert "Matched comparisons" not in build_report(runs, tmp_path, "one criterion").markdown
