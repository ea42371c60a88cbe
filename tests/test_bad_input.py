"""Bad input to every entry script ends at the one error boundary (t6.cli.entry): exit code 2, one message
naming the field or file and the fix, no traceback; a bug keeps its traceback. The scripts run in this process
(their @hydra.main with a command line, as `python SCRIPT.py ARGS` runs them); tests/test_cli.py runs some as
processes of their own."""

from __future__ import annotations

import json
import logging
import runpy
import sys
from pathlib import Path

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra

from conftest import ROOT, TEST_SIZE, compose_config


@pytest.fixture(autouse=True)
def _logging_restored():
    """A script's Hydra configures logging for the whole process (summary.py's disables every logger): put it back
    for the tests that run after these."""
    loggers = {name: (lg.disabled, lg.level, list(lg.handlers), lg.propagate) for name, lg in all_loggers()}
    root = (logging.root.level, list(logging.root.handlers))
    yield
    for name, lg in all_loggers():
        lg.disabled, lg.level, lg.handlers, lg.propagate = loggers.get(name, (False, logging.NOTSET, [], True))
    logging.root.level, logging.root.handlers = root


def all_loggers():
    return [(name, lg) for name, lg in logging.root.manager.loggerDict.items() if isinstance(lg, logging.Logger)]


def run(name: str, *args: str, monkeypatch, capsys) -> tuple[int, str]:
    """`python NAME.py ARGS` in this process (the script run as __main__: its registration and its entry into the
    error boundary): (exit code, stderr)."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / f"{name}.py"), *args])
    for key, value in {"T6_ROOT": str(ROOT), "HYDRA_FULL_ERROR": "1"}.items():  # what the script sets, undone after
        monkeypatch.setenv(key, value)
    GlobalHydra.instance().clear()
    code = 0
    try:
        runpy.run_path(str(ROOT / f"{name}.py"), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A training checkpoint of the test-sized TPA model (random weights), as train.py writes one."""
    from dataclasses import asdict

    from t6.hydra_config import model_config
    from t6.training.module import T6LitModule

    fields = asdict(model_config(compose_config(TEST_SIZE, tmp_path)))
    path = tmp_path / "last.ckpt"
    module = T6LitModule(model_config=fields)
    torch.save(
        {"state_dict": module.state_dict(), "hyper_parameters": {"model_config": fields}, "global_step": 4}, path
    )
    return path


@pytest.fixture
def truncated(checkpoint, tmp_path) -> Path:
    path = tmp_path / "cut.ckpt"
    path.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])
    return path


def test_generate_names_a_bad_setting_a_damaged_checkpoint_and_a_prompt_too_long(
    checkpoint, truncated, monkeypatch, capsys
):
    code, err = run("generate", f"ckpt_path={checkpoint}", "max_new_tokens=-5", monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2 and "error: max_new_tokens=-5 must be a positive number of tokens" in err
    code, err = run("generate", f"ckpt_path={checkpoint}", "top_p=2", monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2 and "top_p=2 must be in (0, 1] or null" in err
    code, err = run("generate", f"ckpt_path={truncated}", monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2 and f"ckpt_path='{truncated}' is not a readable checkpoint" in err
    long = "prompt='" + "O Romeo " * 40 + "'"
    code, err = run("generate", f"ckpt_path={checkpoint}", long, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2 and "exceeds the model's context of 64 tokens (size.block_size)" in err
    code, err = run("generate", f"ckpt_path={checkpoint}", "prompt=[]", monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2 and "error: prompt=[] gives nothing to continue" in err
    code, err = run("generate", f"ckpt_path={checkpoint}", "attention=mha", monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2 and "attention= is not a setting of this script" in err
    assert "comes from the checkpoint they read (ckpt_path=...)" in err and "+attention" not in err
    code, _ = run("generate", f"ckpt_path={checkpoint}", "max_new_tokens=3", monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0


@pytest.mark.parametrize("bug", [RuntimeError("a bug in generation"), ValueError("max() arg is an empty sequence")])
def test_a_bug_keeps_its_traceback(bug, checkpoint, monkeypatch, capsys):
    """Only the errors the project raises on purpose (t6.errors.UserError) are a user's: a ValueError from inside a
    library or a slip of ours is a bug, and leaves with its traceback."""

    def broken(*args, **kwargs):
        raise bug

    monkeypatch.setattr("t6.inference.generate.generate_text", broken)
    with pytest.raises(type(bug), match=str(bug).replace("(", ".").replace(")", ".")):  # not an exit 2
        run("generate", f"ckpt_path={checkpoint}", "max_new_tokens=3", monkeypatch=monkeypatch, capsys=capsys)


def test_export_names_an_out_that_is_a_file_and_a_damaged_checkpoint(
    checkpoint, truncated, tmp_path, monkeypatch, capsys
):
    taken = tmp_path / "taken"
    taken.write_text("a file")
    code, err = run("export", f"ckpt_path={checkpoint}", f"out={taken}", monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2 and f"error: out='{taken}' is a file; give a directory" in err
    code, err = run("export", f"ckpt_path={truncated}", f"out={tmp_path / 'x'}", monkeypatch=monkeypatch, capsys=capsys)
    assert (
        code == 2 and f"ckpt_path='{truncated}' is not a readable checkpoint" in err and not (tmp_path / "x").exists()
    )


def test_eval_and_convert_name_a_damaged_or_missing_checkpoint(truncated, tmp_path, monkeypatch, capsys):
    code, err = run(
        "eval", f"ckpt_path={truncated}", f"paths.root_dir={tmp_path}", monkeypatch=monkeypatch, capsys=capsys
    )
    assert code == 2 and f"ckpt_path='{truncated}' is not a readable checkpoint" in err
    code, err = run(
        "convert", "ckpt_path=nope.ckpt", f"out={tmp_path / 'g.ckpt'}", monkeypatch=monkeypatch, capsys=capsys
    )
    assert code == 2 and "ckpt_path='nope.ckpt' does not exist" in err


def test_convert_names_calibration_windows_longer_than_the_sources_context(checkpoint, tmp_path, monkeypatch, capsys):
    out = tmp_path / "mqa.ckpt"
    code, err = run("convert", f"ckpt_path={checkpoint}", "target=mqa", f"out={out}", "tracking_uri=null",
                    monkeypatch=monkeypatch, capsys=capsys)  # fmt: skip
    assert code == 2 and "error: data.seq_len=256: the calibration windows are longer than the source's" in err
    assert "size.block_size=64); set data.seq_len<=64" in err and not out.exists()


def test_eval_reads_the_checkpoint_before_it_loads_any_task(tmp_path, monkeypatch, capsys):
    """A file of random bytes is named at once: the tasks and their datasets (lm-eval's index, ~100 s on a busy
    machine) come after the cheap checks."""
    noise = tmp_path / "noise.ckpt"
    noise.write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
                      .numpy().tobytes())  # fmt: skip

    def too_early(*args, **kwargs):
        pytest.fail("the tasks were loaded before the checkpoint was read")

    monkeypatch.setattr("t6.evaluation.evaluate.build_eval_callback", too_early)
    code, err = run(
        "eval", f"ckpt_path={noise}", "eval=paper", f"paths.root_dir={tmp_path}", monkeypatch=monkeypatch, capsys=capsys
    )
    assert code == 2 and f"ckpt_path='{noise}' is not a readable checkpoint" in err


def test_prepare_names_the_text_field_the_rows_lack_and_a_missing_file(tmp_path, monkeypatch, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"body": f"document {i}"}) for i in range(5)) + "\n")
    code, err = run(
        "prepare",
        "dataset=local",
        f"dataset.data_files={rows}",
        f"dataset.out_dir={tmp_path / 'out'}",
        f"paths.root_dir={tmp_path}",
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert code == 2 and "dataset.text_field='text': the rows of" in err and "(they have: body)" in err
    code, err = run("prepare", "dataset=local", f"dataset.data_files={tmp_path / 'nope.jsonl'}",
                    f"dataset.out_dir={tmp_path / 'out'}", monkeypatch=monkeypatch, capsys=capsys)  # fmt: skip
    assert code == 2 and f"error: dataset.data_files='{tmp_path / 'nope.jsonl'}' does not exist; give" in err


def test_report_names_a_damaged_sweep_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "mlflow_sweep.json").write_text('{"tracking_uri": ')
    code, err = run("report", "--sweep", str(tmp_path), monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2 and f"{tmp_path / 'mlflow_sweep.json'} is not the JSON a sweep writes" in err


def test_summary_names_a_setting_that_builds_no_model(monkeypatch, capsys):
    code, err = run("summary", "size.head_dim=63", monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2 and "size.head_dim=63 must be even" in err
