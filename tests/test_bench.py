"""The benchmarks' shared harness: which mechanisms `--attentions` selects, that `all` reaches
every registered mechanism (one registered without a YAML too), and that the KV bytes per token
the benchmarks report (t6.model.facts) are what the caches really allocate."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from t6.bench import common, kv_memory, prefill
from t6.config import conf_dir
from t6.model.attention import PAPER, available

ROOT = Path(__file__).resolve().parents[1]


def test_conf_dir_is_the_checkouts_conf():
    assert conf_dir() == ROOT / "conf"


def test_attentions_default_to_the_papers_six_and_accept_groups():
    parser = argparse.ArgumentParser()
    common.attention_args(parser)
    assert parser.parse_args([]).attentions == list(PAPER)
    assert parser.parse_args(["--attentions", "all"]).attentions == available()
    assert parser.parse_args(["--attentions", "tpa,paper"]).attentions == ["tpa", *[n for n in PAPER if n != "tpa"]]


def test_unknown_mechanism_is_a_usage_error_naming_it(capsys):
    with pytest.raises(SystemExit):
        prefill.main(["--attentions", "paper,no_such_attention", "--size", "tiny", "--contexts", "8"])
    err = capsys.readouterr().err
    assert "--attentions" in err and "no_such_attention" in err and "tpa" in err


@pytest.fixture(scope="module")
def kv_all(tmp_path_factory) -> dict[str, dict]:
    """kv_memory --attentions all at size tiny, by mechanism."""
    out = tmp_path_factory.mktemp("kv") / "kv.json"
    kv_memory.main(["--attentions", "all", "--sizes", "tiny", "--dtype", "float32", "--json", str(out)])
    return {r["attention"]: r for r in json.loads(out.read_text())["records"]}


def test_all_selects_nothing_else(kv_all):
    assert sorted(kv_all) == available()


@pytest.mark.parametrize("name", available())
def test_all_covers_every_registered_mechanism_and_its_cache_fact_holds(kv_all, name):
    r = kv_all[name]
    assert r["kv_cache_bytes_per_token"] == r["allocated_bytes_per_token"] > 0
    assert r["kv_cache_bytes_per_token"] == 4 * r["n_layer"] * r["elements_per_token_layer"]  # fp32


@pytest.mark.slow  # three fresh processes (~30 s on 2 cores)
def test_loss_bench_runs_each_setting_liger_included(tmp_path, monkeypatch):
    """`t6.bench.loss --chunks none,8,liger`: every setting trains in its own process (Liger's kernel on
    the CPU through Triton's interpreter, which the spawned process reads from the environment)."""
    from t6.bench import loss

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the interpreter reads CPU tensors only, on a CUDA machine too
    out = tmp_path / "loss.json"
    args = "--size tiny --batch-size 1 --seq-len 16 --steps 1 --warmup 0 --threads 1 --override size.n_layer=1"
    args += " --device cpu"
    rows = loss.main([*args.split(), "--chunks", "none,8,liger", "--json", str(out)])
    assert [r["chunk_tokens"] for r in rows] == ["none", 8, "liger"]
    assert all(r["step_ms"] > 0 and r["peak_mib"] > 0 for r in rows)
    assert json.loads(out.read_text())["rows"][2]["chunk_tokens"] == "liger"
