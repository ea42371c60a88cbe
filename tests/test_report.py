"""report.py: tables and figures from real MLflow runs.

Two runs are real (`train(cfg)`); the downstream-evaluation results, a second seed, a failed run and
a run missing a metric are logged into the same store with the real MlflowClient as test data."""

from __future__ import annotations

import json
import statistics
import time

import mlflow
import pytest
import yaml
from mlflow.entities import Metric, Param

from t6.errors import UserError
from t6.report import (
    Cell,
    RunData,
    aggregate,
    build_report,
    curve,
    group_runs,
    last_step,
    model_stats_from_params,
    plot_curves,
    task_metric,
    task_order,
    tokens_per_step,
)
from t6.report.stats import difference
from t6.run.train import main as train


def load_cli():
    """What `python report.py` runs (the script itself is t6.cli.entry around this module's main)."""
    from t6.report import mlflow_report

    return mlflow_report


# --------------------------------------------------------------------------- pure functions


def test_task_metric_follows_the_paper_and_falls_back_to_acc():
    assert task_metric("hellaswag", {"acc", "acc_norm"}) == "acc_norm"
    assert task_metric("arc_challenge", {"acc"}) == "acc_norm"  # the paper's choice, even when not logged
    assert task_metric("winogrande", {"acc", "acc_norm"}) == "acc"
    assert task_metric("mmlu", {"acc"}) == "acc"
    assert task_metric("t6_local", {"acc", "acc_norm", "acc_stderr"}) == "acc_norm"
    assert task_metric("t6_local", {"acc", "acc_stderr"}) == "acc"
    assert task_metric("lambada", {"perplexity", "perplexity_stderr"}) == "perplexity"
    assert task_metric("t6_cloze", {"acc", "acc_norm"}) == "acc"  # conf/eval/local.yaml's choice, not acc_norm


def test_task_columns_follow_the_eval_configs(tmp_path):
    from t6.report.evals import EVAL_CONF, eval_config_metrics, paper_tasks

    paper = yaml.safe_load((EVAL_CONF / "paper.yaml").read_text())
    local = yaml.safe_load((EVAL_CONF / "local.yaml").read_text())
    assert eval_config_metrics() == {**paper["metrics"], **local["metrics"]}
    assert paper_tasks() == tuple(paper["tasks"])
    assert task_order(["t6_local", "mmlu", "social_iqa", "arc_easy", "winogrande"]) == [
        "arc_easy",
        "winogrande",
        "mmlu",
        "social_iqa",
        "t6_local",
    ]  # paper.yaml's order, then by name

    (tmp_path / "paper.yaml").write_text("tasks: [boolq]\nmetrics: {boolq: acc}\n")
    (tmp_path / "mine.yaml").write_text("metrics: {boolq: acc_norm}\n")
    with pytest.raises(ValueError, match="task 'boolq' has metric 'acc_norm' in .*mine.yaml but 'acc' in .*paper.yaml"):
        eval_config_metrics(tmp_path)
    with pytest.raises(FileNotFoundError, match="paper.yaml does not exist"):
        eval_config_metrics(tmp_path / "nowhere")


def test_tokens_per_step_from_params():
    assert (
        tokens_per_step(
            {"data.global_batch_size": "480", "data.batch_size": "20", "data.seq_len": "1024", "trainer.devices": "8"}
        )
        == 480 * 1024
    )
    assert (
        tokens_per_step(
            {
                "data.global_batch_size": "None",
                "data.batch_size": "8",
                "data.seq_len": "256",
                "trainer.devices": "2",
                "trainer.num_nodes": "2",
            }
        )
        == 8 * 2 * 2 * 256
    )
    with pytest.raises(KeyError, match="data.seq_len"):
        tokens_per_step({"data.batch_size": "8", "trainer.devices": "1"})
    with pytest.raises(KeyError, match="trainer.devices=auto or -1"):
        tokens_per_step({"data.batch_size": "8", "data.seq_len": "64", "trainer.devices": "auto"})


def test_aggregate_is_mean_and_sample_std_and_counts_missing():
    cell = aggregate([0.5, 0.6, 0.7])
    assert cell.mean == pytest.approx(0.6) and cell.std == pytest.approx(0.1)
    assert cell.format(100.0) == "60.00 ± 10.00"
    assert aggregate([0.5], expected=3).format(100.0) == "50.00 (1/3 runs)"
    assert aggregate([], expected=2) == Cell(None, None, 0, 2) and aggregate([], 2).format() == "–"


def test_curve_places_step_s_at_s_plus_one_steps_of_tokens():
    params = {"data.batch_size": "2", "data.seq_len": "10", "trainer.devices": "1"}
    a = RunData("a", "a", "FINISHED", params, history={"val/loss": [(0, 4.0), (1, 3.0), (2, 2.0)]})
    b = RunData("b", "b", "FINISHED", params, history={"val/loss": [(0, 6.0), (1, 5.0)]})
    tokens, mean, std = curve([a, b], "val/loss")
    assert tokens == [20.0, 40.0] and mean == [5.0, 4.0]  # only the steps both runs logged
    assert std == pytest.approx([statistics.stdev([4, 6])] * 2)


# --------------------------------------------------------------------------- from a real store

EVALS = {  # run -> {shots: {task: {metric: value}}}: downstream results logged as test data
    "mha-1": {
        0: {"arc_easy": {"acc": 0.35, "acc_norm": 0.30}, "boolq": {"acc": 0.60}, "t6_local": {"acc": 0.25}},
        2: {"arc_easy": {"acc_norm": 0.32}, "boolq": {"acc": 0.62}, "t6_local": {"acc": 0.27}},
    },
    "mha-2": {
        0: {"arc_easy": {"acc_norm": 0.40}, "boolq": {"acc": 0.50}, "t6_local": {"acc": 0.35}},
        2: {"arc_easy": {"acc_norm": 0.42}, "boolq": {"acc": 0.52}, "t6_local": {"acc": 0.37}},
    },
    "tpa-1": {
        0: {"arc_easy": {"acc_norm": 0.45}, "boolq": {"acc": 0.54}, "t6_local": {"acc": 0.40}},
        2: {"arc_easy": {"acc_norm": 0.46}, "boolq": {"acc": 0.56}, "t6_local": {"acc": 0.41}},
    },
    "tpa-2": {
        0: {"arc_easy": {"acc_norm": 0.47}, "t6_local": {"acc": 0.38}},  # no boolq: a missing metric
        2: {"arc_easy": {"acc_norm": 0.48}, "boolq": {"acc": 0.58}, "t6_local": {"acc": 0.39}},
    },
}


def log_evals(client, run_id, results):
    now = int(time.time() * 1000)
    metrics = [
        Metric(f"eval/{shots}shot/{task}/{metric}", value, now, 7)
        for shots, tasks in results.items()
        for task, ms in tasks.items()
        for metric, value in ms.items()
    ]
    client.log_batch(run_id, metrics=metrics)


def copy_as_seed(client, source, experiment_id, name, seed, offset):
    """A finished second-seed run: the source run's params with another seed, and its curves shifted by offset."""
    run_id = client.create_run(
        experiment_id, run_name=name, tags={k: v for k, v in source.data.tags.items() if not k.startswith("mlflow.")}
    ).info.run_id
    params = [Param(k, str(seed) if k in ("seed", "data.seed") else v) for k, v in source.data.params.items()]
    for i in range(0, len(params), 100):
        client.log_batch(run_id, params=params[i : i + 100])
    for key in ("train/loss", "val/loss", "val/ppl"):
        history = client.get_metric_history(source.info.run_id, key)
        client.log_batch(run_id, metrics=[Metric(key, m.value + offset, m.timestamp, m.step) for m in history])
    client.set_terminated(run_id, "FINISHED")
    return run_id


@pytest.fixture
def store(make_cfg):
    """Real mha and tpa runs + a second seed of each, a failed run, and eval results, in one SQLite store."""
    trained = {}
    for attention in ("mha", "tpa"):
        cfg = make_cfg(
            f"attention={attention}",
            "run_name=" + attention + "-1",
            "experiment_name=cmp",
            "callbacks.model_checkpoint=null",
            "seed=1",
        )
        _, objects = train(cfg)
        trained[attention] = objects
    uri = cfg.logger.mlflow.tracking_uri
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment_id = trained["mha"]["mlflow"].experiment_id
    ids = {f"{a}-1": trained[a]["mlflow"].run_id for a in trained}
    for attention, offset in (("mha", 0.5), ("tpa", 0.25)):
        ids[f"{attention}-2"] = copy_as_seed(
            client, client.get_run(ids[f"{attention}-1"]), experiment_id, f"{attention}-2", 2, offset
        )
    for name, results in EVALS.items():
        log_evals(client, ids[name], results)
    failed = client.create_run(experiment_id, run_name="tpa-3", tags={"attention": "tpa"}).info.run_id
    client.log_param(failed, "attention.name", "tpa")
    client.log_metric(failed, "val/loss", 99.0, step=3)
    client.set_terminated(failed, "FAILED")
    ids["tpa-3"] = failed
    return {"uri": uri, "client": client, "experiment_id": experiment_id, "ids": ids, "trained": trained}


@pytest.mark.slow  # trains the runs it reports on (~6 s)
def test_report_from_real_runs(store, tmp_path):
    client, ids, trained = store["client"], store["ids"], store["trained"]
    decode = tmp_path / "decode.json"
    decode.write_text(
        json.dumps(
            [
                {"attention": "mha", "context": 64, "tokens_per_s": 100.0, "kv_cache_bytes_per_token": 1},
                {"attention": "mha", "context": 64, "tokens_per_s": 120.0, "kv_cache_bytes_per_token": 1},
                {"attention": "tpa", "context": 64, "tokens_per_s": 150.0, "kv_cache_bytes_per_token": 1},
            ]
        )
    )
    out = load_cli().main(
        [
            "--experiment",
            "cmp",
            "--tracking-uri",
            store["uri"],
            "--out",
            str(tmp_path / "rep"),
            "--decode-json",
            str(decode),
        ]
    )
    md = (out / "report.md").read_text()
    lines = md.splitlines()

    def row(title: str, label: str) -> str:
        start = next(i for i, line in enumerate(lines) if line.startswith("## " + title))
        return next(line for line in lines[start:] if line.startswith(f"| {label} |"))

    # zero-shot: mha over 2 seeds; tpa's boolq and average only from the seed that has all tasks
    assert "| attention | arc_easy (acc_norm) | boolq (acc) | t6_local (acc) | Avg. |" in md
    avg_mha = statistics.fmean([statistics.fmean([0.30, 0.60, 0.25]), statistics.fmean([0.40, 0.50, 0.35])])
    assert row("Zero-shot", "mha") == (
        f"| mha | 35.00 ± 7.07 | **55.00 ± 7.07** | 30.00 ± 7.07 | {avg_mha * 100:.2f} ± 2.36 |"
    )
    assert row("Zero-shot", "tpa") == (
        "| tpa | **46.00 ± 1.41** | 54.00 (1/2 runs) | **39.00 ± 1.41** | "
        f"**{(0.45 + 0.54 + 0.40) / 3 * 100:.2f} (1/2 runs)** |"
    )
    two_shot = [statistics.fmean([0.46, 0.56, 0.41]), statistics.fmean([0.48, 0.58, 0.39])]
    assert row("Two-shot", "tpa").endswith(
        f"| **{statistics.fmean(two_shot) * 100:.2f} ± {statistics.stdev(two_shot) * 100:.2f}** |"
    )
    assert "- tpa-2 (" in md and "eval/0shot/boolq/acc" in md  # the missing metric is named

    # the failed run is listed and kept out of every number
    assert row("Runs", "tpa-3").endswith("| FAILED | 4 | 99.0000 | no: status FAILED |")
    assert row("Runs", "mha-1").split(" | ")[5] == "8"  # the last_step tag train() sets
    val = {a: trained[a]["trainer"].callback_metrics["val/loss"].item() for a in trained}
    assert row("Final losses", "mha").split(" | ")[2].strip("*") == (
        f"{statistics.fmean([val['mha'], val['mha'] + 0.5]):.4f} ± "
        f"{statistics.stdev([val['mha'], val['mha'] + 0.5]):.4f}"
    )

    # parameters and KV logged by train() (model/...) equal the trained model's; the meta-device
    # fallback (runs without them) gives the same parameter count
    for attention, tok_s in (("mha", "110.0"), ("tpa", "150.0")):
        model = trained[attention]["model"].model
        kv = sum(sum(s.numel() for s in c.tensors.values()) for c in model.build_kv_caches(1, 1)) * 2  # bf16
        assert row("Memory", attention).startswith(
            f"| {attention} | {model.num_params() / 1e6:.2f}M | {kv / 1024:.1f} KiB | {tok_s} |"
        )
    assert (
        model_stats_from_params(client.get_run(ids["tpa-1"]).data.params)["params"]
        == trained["tpa"]["model"].model.num_params()
    )

    # figures are real PNGs, and everything is logged to a new `report` run
    import matplotlib.image

    for name in ("train_loss.png", "val_loss.png", "val_ppl.png"):
        assert matplotlib.image.imread(out / name).shape[2] in (3, 4)
    reports = client.search_runs([store["experiment_id"]], "tags.`t6.kind` = 'report'")
    assert len(reports) == 1
    logged = {a.path for a in client.list_artifacts(reports[0].info.run_id, "report")}
    assert logged == {"report/report.md", "report/train_loss.png", "report/val_loss.png", "report/val_ppl.png"}

    # a second report over the experiment ignores the first report run
    md2 = (
        load_cli().main(
            ["--experiment", "cmp", "--tracking-uri", store["uri"], "--out", str(tmp_path / "rep2"), "--no-log"]
        )
        / "report.md"
    ).read_text()
    assert "| report |" not in md2 and md2.count("| yes |") == 4


@pytest.mark.slow  # trains a sweep to report on (~5 s)
def test_report_on_a_sweep_parent_logs_to_the_parent_and_bad_input_fails_clearly(store, tmp_path):
    """Bad input is a UserError naming it (report.py's entry prints it, exit 2)."""
    client, ids = store["client"], store["ids"]
    cli = load_cli()
    with pytest.raises(UserError, match="no MLflow experiment named 'nope'.*cmp"):
        cli.main(["--experiment", "nope", "--tracking-uri", store["uri"], "--no-log"])
    with pytest.raises(UserError, match="has no sweep parent run; drop --parent"):
        cli.main(["--experiment", "cmp", "--parent", "latest", "--tracking-uri", store["uri"], "--no-log"])
    with pytest.raises(UserError, match="decode benchmark JSON"):
        cli.main(["--experiment", "cmp", "--tracking-uri", store["uri"], "--decode-json", str(tmp_path / "x.json")])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"attention": "mha"}]))
    with pytest.raises(UserError, match="record 0 lacks context, tokens_per_s"):
        cli.main(["--experiment", "cmp", "--tracking-uri", store["uri"], "--decode-json", str(bad)])

    parent = client.create_run(store["experiment_id"], run_name="sweep").info.run_id
    for name in ("mha-1", "mha-2", "tpa-3"):
        client.set_tag(ids[name], "mlflow.parentRunId", parent)
    out = cli.main(
        ["--experiment", "cmp", "--parent", "latest", "--tracking-uri", store["uri"], "--out", str(tmp_path / "rep")]
    )
    md = (out / "report.md").read_text()
    assert md.startswith(f"# cmp: sweep ({parent[:8]})")  # the parent run's name, once
    assert "| mha-1 |" in md and "| tpa-3 |" in md and "| tpa-1 |" not in md  # only this sweep's children
    assert "report/report.md" in {a.path for a in client.list_artifacts(parent, "report")}


def test_build_report_without_finished_runs_says_so(tmp_path):
    run = RunData("abc12345", "x", "RUNNING", {"attention.name": "mha"})
    report = build_report([run], tmp_path, "t")
    assert "| x | abc12345 | mha | – | RUNNING | – | – | no: status RUNNING |" in report.markdown
    assert "No finished run to report on." in report.markdown


@pytest.mark.slow  # trains a sweep to report on (~5 s)
def test_report_on_a_sweep_directory_reads_its_store_and_parent(store, tmp_path):
    from t6.tracking.sweep import SWEEP_FILE

    client, ids = store["client"], store["ids"]
    cli = load_cli()
    with pytest.raises(UserError, match="not-a-sweep is not the directory of a sweep"):  # entry: exit 2, no traceback
        cli.main(["--sweep", str(tmp_path / "not-a-sweep")])
    parent = client.create_run(store["experiment_id"], run_name="sweep").info.run_id
    client.set_tag(ids["tpa-3"], "mlflow.parentRunId", parent)
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / SWEEP_FILE).write_text(json.dumps({"tracking_uri": store["uri"], "parent_run_id": parent}))
    out = cli.main(["--sweep", str(sweep), "--out", str(tmp_path / "rep"), "--no-log"])
    md = (out / "report.md").read_text()
    assert "| tpa-3 |" in md and "| mha-1 |" not in md  # only the sweep's child


# --------------------------------------------------------------------------- pooling, folders, markers

SETUP = {
    "attention.name": "tpa",
    "data.seq_len": "64",
    "data.batch_size": "4",
    "trainer.devices": "1",
    "trainer.max_steps": "30",
    "data.data_dir": "/d/shakespeare",
    "paths.output_dir": "/runs/a",
}


def run_with(run_id: str, seed: int, val: float, **changes: str) -> RunData:
    params = {**SETUP, "seed": str(seed), "paths.output_dir": f"/runs/{run_id}", **changes}
    return RunData(run_id * 8, run_id, "FINISHED", params, metrics={"val/loss": val, "train/loss": val, "val/ppl": 2.0})


def test_only_runs_that_differ_in_the_seed_alone_are_pooled(tmp_path):
    # a recipe's `compare` only chose which mechanisms its sweep trained: a seed re-run with another list still pools
    # and the plan's measurements of a loaded machine (memory estimate, matmul peak, the checkpoint interval they
    # time) differ between seeds of one setting without changing what a run computes
    same = [
        run_with("a", 1, 5.0, compare="['paper', 'gta']", **{"plan/peak_tflops": "0.1012"}),
        run_with(
            "b", 2, 6.0, compare="['paper']", **{"plan/peak_tflops": "0.0483", "plan/memory_estimate_gib": "1.07"}
        ),
    ]
    grouped = group_runs(same)
    assert list(grouped.groups) == ["tpa"] and len(grouped.groups["tpa"]) == 2 and not grouped.notes

    mixed = same + [run_with("c", 1, 4.0, **{"trainer.max_steps": "35", "data.data_dir": "/d/local"})]
    grouped = group_runs(mixed)
    assert list(grouped.groups) == [
        "tpa (data.data_dir=/d/shakespeare, trainer.max_steps=30)",
        "tpa (data.data_dir=/d/local, trainer.max_steps=35)",
    ]
    assert grouped.notes == [
        "tpa: its runs differ in more than the seed (data.data_dir, trainer.max_steps), so they "
        "are not averaged together: one row per setting"
    ]
    md = build_report(mixed, tmp_path, "t").markdown
    assert "| tpa (data.data_dir=/d/local, trainer.max_steps=35) | **4.0000** |" in md  # alone: no ±, not pooled
    assert "| tpa (data.data_dir=/d/shakespeare, trainer.max_steps=30) | 5.5000 ± 0.7071 |" in md
    assert "Not pooled:" in md


def test_last_step_prefers_the_runs_own_record():
    run = RunData("r", "r", "FINISHED", {}, history={"train/loss": [(9, 1.0), (19, 1.0), (29, 1.0)]})
    assert last_step(run) == 30  # from the curve: logged every 10 steps
    run.tags["last_step"] = "35"
    assert last_step(run) == 35


def test_a_curve_of_one_point_is_drawn_with_a_marker(tmp_path):
    import matplotlib.image
    import numpy as np

    runs = [run_with("a", 1, 5.0)]
    runs[0].history = {"val/loss": [(29, 5.0)]}
    assert plot_curves({"tpa": runs}, "val/loss", tmp_path / "one.png") == []
    image = matplotlib.image.imread(tmp_path / "one.png")[..., :3]
    blue = np.all(np.abs(image - np.array([0x1F, 0x77, 0xB4]) / 255) < 0.05, axis=-1)  # matplotlib's first colour
    assert blue.sum() > 110  # the marker in the axes and in the legend (72 pixels without markers: the legend alone)


def test_every_line_of_a_sweep_of_all_mechanisms_has_its_own_style():
    """Fourteen mechanisms (every registered one) on one figure: matplotlib's cycle repeats its ten
    colours, which drew MHA and another mechanism alike; colours then line styles keep each apart."""
    import matplotlib
    import matplotlib.colors

    from t6.report.plots import line_style

    styles = [line_style(i) for i in range(40)]
    assert len(set(styles)) == 40
    default_cycle = [matplotlib.colors.to_hex(c) for c in matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]]
    assert [color for color, _ in styles[:10]] == default_cycle  # the first ten look as matplotlib draws them
    assert {style for _, style in styles[:10]} == {"-"}


def test_report_folder_has_no_spaces():
    cli = load_cli()
    assert cli.folder_name("sweep 2026-01-02_03-04-05") == "sweep-2026-01-02_03-04-05"
    assert cli.folder_name("my study / v2") == "my-study-v2"


def test_every_mechanism_in_the_runs_has_a_row_in_every_table_paper_order_first(make_cfg, tmp_path):
    """Mechanisms outside the paper's six (tpa_nc_a, tpa_third_order) get rows like the paper's, after
    them: the paper's in t6.model.attention.PAPER order, then the others by name, whatever the run order."""
    from omegaconf import OmegaConf

    from t6.hydra_config import flatten, model_config
    from t6.model.attention import PAPER
    from t6.model.facts import model_facts

    runs, facts = [], {}
    for i, attention in enumerate(("tpa_third_order", "tpa", "tpa_nc_a", "mha")):
        cfg = make_cfg(f"attention={attention}")
        model = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("size", "attention")}
        params = {**SETUP, **{k: str(v) for k, v in flatten(model).items()}, "seed": "1"}
        metrics = {
            "val/loss": 5.0 - i,
            "train/loss": 5.0,
            "val/ppl": 2.0,
            "eval/0shot/arc_easy/acc_norm": 0.3 + i / 10,
            "eval/0shot/t6_cloze/acc": 0.5,
            "eval/0shot/t6_cloze/acc_norm": 0.6,
        }
        runs.append(RunData(f"{attention}-run", attention, "FINISHED", params, metrics=metrics))
        facts[attention] = model_facts(model_config(cfg))
        assert model_stats_from_params(params) == facts[attention]
    assert "tpa_nc_a" not in PAPER and "tpa_third_order" not in PAPER

    md = build_report(runs, tmp_path, "t").markdown
    lines = md.splitlines()
    order = ["mha", "tpa", "tpa_nc_a", "tpa_third_order"]
    for title in ("Final losses", "Zero-shot", "Memory"):
        start = next(i for i, line in enumerate(lines) if line.startswith("## " + title))
        end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
        rows = [line.split(" | ")[0][2:] for line in lines[start:end] if line.startswith("| ") and "|---" not in line]
        assert rows == ["attention", *order], title
    assert "| attention | arc_easy (acc_norm) | t6_cloze (acc) | Avg. |" in md
    assert "| tpa_nc_a | 50.00 | **50.00** | 50.00 |" in md  # arc_easy 0.3 + 2/10, t6_cloze acc 0.5 (all tied)
    kv = facts["tpa_nc_a"]["kv_cache_bytes_per_token"]
    assert f"| tpa_nc_a | {facts['tpa_nc_a']['params'] / 1e6:.2f}M | {kv / 1024:.1f} KiB |" in md


def test_welch_difference_resolves_separated_seeds_only():
    far = difference([5.0, 5.01, 4.99], [6.0, 6.02, 5.98])
    assert far.delta == pytest.approx(-1.0) and far.resolved and far.p < 1e-3
    near = difference([5.0, 5.2, 4.8], [5.05, 4.85, 5.25])
    assert near.delta == pytest.approx(-0.05) and not near.resolved and near.p > 0.5
    assert difference([5.0], [6.0, 6.1]).p is None and difference([], [1.0]) is None


def test_report_names_the_differences_from_mha_that_the_seeds_resolve(tmp_path):
    def runs(attention: str, losses: list[float], cloze: list[float]) -> list[RunData]:
        out = []
        for seed, (loss, acc) in enumerate(zip(losses, cloze), start=1):
            run = run_with(f"{attention}{seed}", seed, loss, **{"attention.name": attention})
            run.metrics["eval/0shot/t6_cloze/acc"] = acc
            out.append(run)
        return out

    md = build_report(
        runs("mha", [6.0, 6.02, 5.98], [0.30, 0.31, 0.29])
        + runs("mla", [5.7, 5.71, 5.69], [0.305, 0.29, 0.31])  # loss far below MHA's, cloze within the noise
        + runs("gqa", [6.1, 5.9, 6.05], [0.30, 0.32, 0.28]),  # both within the noise
        tmp_path,
        "t",
    ).markdown
    section = md.split("## Differences from mha that the seeds resolve")[1].split("\n## ")[0]
    assert "| attention | Δ val/loss | Δ 0-shot t6_cloze (acc) | Δ 0-shot Avg. |" in section
    mla = next(line for line in section.splitlines() if line.startswith("| mla |"))
    assert mla.startswith("| mla | **-0.300 (p=0.000)** | +0.17 (p=0.") and "| mha |" not in section
    assert "Resolved: mla val/loss -0.300 (p=0.000)." in section  # gqa's and the cloze's differences are not
