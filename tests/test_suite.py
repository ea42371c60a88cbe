"""`python -m t6.bench.suite`: each stage in its own process and timeout, its outcome in suite.json as soon as it
ends (a stage that hangs or fails costs only itself, the budget stops the rest), and the --smoke run of every
stage at tiny shapes on the CPU, whose tables are rendered from their JSON like every measured table."""

from __future__ import annotations

import json

import pytest

from t6.bench import suite
from t6.bench.suite import Settings, Stage


def python(code: str):
    return lambda s: [s.python, "-c", code]


def test_a_stage_that_hangs_or_fails_costs_only_itself_and_the_budget_stops_the_rest(tmp_path):
    stages = [
        Stage("hangs", "sleeps past its timeout", 1, 1, python("import time; time.sleep(60)")),
        Stage("fails", "exits with an error", 30, 30, python("raise SystemExit(3)")),
        Stage("works", "writes its JSON", 30, 30, python("print('measured')")),
        Stage("waits", "takes what the budget has left", 60, 60, python("import time; time.sleep(60)")),
        Stage("late", "starts too late", 30, 30, python("print('never')")),
    ]
    budget = 1 + suite.MIN_START_S + 8  # the fourth stage starts with ~28 s left and is cut there
    outcomes = suite.run(Settings(tmp_path, "cpu", smoke=True), stages, budget)
    statuses = [o["status"] for o in outcomes]
    assert statuses[:3] == ["timeout (1 s)", "failed (exit 3)", "ok"]
    assert statuses[3].startswith("timeout (") and statuses[4] == "skipped (budget spent)"
    assert "measured" in (tmp_path / "logs" / "works.log").read_text()
    written = json.loads((tmp_path / "suite.json").read_text())
    assert written["benchmark"] == "suite" and [r["stage"] for r in written["records"]] == [s.name for s in stages]


def test_unknown_stages_are_a_usage_error_naming_the_stages(capsys):
    with pytest.raises(SystemExit):
        suite.parse_args(["--stages", "machine,warp_drive"])
    assert "warp_drive unknown; the stages are machine, cuda_tests" in capsys.readouterr().err


def test_generate_measures_the_papers_six_unless_the_command_names_others(tmp_path):
    def names(stage, settings):
        command = stage(settings)
        return command[command.index("--attentions") + 1]

    gpu = Settings(tmp_path, "cuda", smoke=False)
    assert names(suite.generate, gpu) == "paper" and names(suite.decode, gpu) == "paper,gta,gla"
    args = suite.parse_args(["--attentions", "gta,paper", "--out", str(tmp_path)])
    assert args.attentions == ["gta", "mha", "mqa", "gqa", "mla", "tpa_kvonly", "tpa"]
    chosen = Settings(tmp_path, "cuda", smoke=False, attentions=",".join(args.attentions))
    assert names(suite.generate, chosen) == names(suite.decode, chosen) == "gta,mha,mqa,gqa,mla,tpa_kvonly,tpa"


@pytest.mark.slow  # every stage in its own process at tiny shapes on the CPU (~2-3 min on 2 idle cores)
def test_the_smoke_run_runs_every_stage_and_renders_their_tables(tmp_path):
    from t6.report.experiments import RENDERERS, render

    outcomes = suite.main(["--smoke", "--out", str(tmp_path), "--budget-s", "1200", "--timeout-scale", "5"])
    assert [o["stage"] for o in outcomes] == [s.name for s in suite.STAGES]
    assert all(o["status"] == "ok" for o in outcomes), outcomes
    for outcome in outcomes:
        payload = json.loads((tmp_path / f"{outcome['stage']}.json").read_text())
        assert payload["benchmark"] in RENDERERS and payload["records"], outcome["stage"]
    readme = tmp_path / "README.md"
    assert render(readme) == readme.read_text() and readme.read_text().count("<!-- end table -->") == 11
    (headline,) = json.loads((tmp_path / "headline.json").read_text())["records"]
    assert headline["fallbacks"] == "none" and headline["eval_s"] > 0 and headline["tokens_per_s"] > 0
    tests = json.loads((tmp_path / "cuda_tests.json").read_text())["records"][0]
    assert tests["tests"] > 0 and tests["failures"] + tests["errors"] == 0
