"""The benchmarks' shared harness: which mechanisms `--attentions` selects, that `all` reaches
every registered mechanism, and that the KV bytes per token
the benchmarks report (t6.model.facts) are what the caches really allocate."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from t6.bench import common, harness, kv_memory, prefill
from t6.bench.common import model_configs
from t6.hydra_config import conf_dir
from t6.model import ModelConfig
from t6.model.attention import PAPER, available
from t6.model.static_decode import StaticDecoder

ROOT = Path(__file__).resolve().parents[1]


def test_conf_dir_is_the_checkouts_conf():
    assert conf_dir() == ROOT / "conf"


def test_attentions_default_to_the_papers_six_and_accept_groups():
    parser = argparse.ArgumentParser()
    harness.attention_args(parser)
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
    assert json.loads(out.read_text())["records"][2]["chunk_tokens"] == "liger"


def test_columns_no_record_has_are_left_out_and_missing_cells_left_empty():
    records = [{"name": "a", "ms": 1.0, "ratio": None}, {"name": "b", "ms": 2.0, "ratio": 0.5}]
    columns = [("name", "name", ""), ("ms", "ms", ".1f"), ("gpu_ms", "GPU ms", ".1f"), ("ratio", "ratio", ".2f")]
    lines = harness.table(records, columns).splitlines()
    assert lines[0].split() == ["name", "ms", "ratio"]  # no record has gpu_ms: no column
    assert lines[2].split() == ["a", "1.0"] and lines[3].split() == ["b", "2.0", "0.50"]


def test_device_and_host_times_are_absent_off_cuda_not_zero():
    calls = []
    for timer in (common.gpu_time_call, common.host_time_call):
        assert timer(lambda: calls.append(1), 3, "cpu") is None
    assert calls == []  # nothing was run to measure nothing


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU time is measured on a CUDA device")
def test_gpu_time_counts_the_kernels_and_stays_under_the_wall_time():
    a = torch.randn(2048, 2048, device="cuda")
    step = lambda: [a @ a for _ in range(4)]  # noqa: E731
    step()
    gpu, wall = common.gpu_time_call(step, 5, "cuda"), common.time_call(step, 5, "cuda")
    host = common.host_time_call(step, 5, "cuda")
    assert 0 < gpu <= wall * 1.05 and 0 < host


def test_decode_kernels_bench_times_each_fused_operator_and_reads_the_whole_cache(capsys):
    """The operator calls of each mechanism's decode step, timed alone on the CPU: one call, whose bytes read are
    the layer's whole cache (the KV fact; GTA's keys are part of its values, GLA's and MLA's values are their
    keys, each read once), their result is the reference's, the bandwidth fraction is consistent, and no GPU
    column appears."""
    from t6.bench import decode_kernels

    out = decode_kernels.main(
        "--device cpu --size tiny --dtype float32 --attentions mha,gta,tpa,mla,gla,tpa_nc_a --contexts 40 "
        "--batches 1,2 --steps 2 --bandwidth-gbs 10".split()
    )
    text = capsys.readouterr().out
    records = {(r["attention"], r["batch"]): r for r in out["records"]}
    assert sorted(records) == [(n, b) for n in ("gla", "gta", "mha", "mla", "tpa") for b in (1, 2)]
    assert "skipped (no fused decode operator): tpa_nc_a" in text and "GPU" not in text
    for (name, batch), r in records.items():
        cfg = common.model_config_of(name, "tiny")
        cache = batch * 41 * common.layer_kv_bytes_per_token(cfg, torch.float32)  # 40 cached tokens + the new one
        assert (r["calls"], r["cache_bytes"]) == (1, cache), name
        assert r["max_abs_err"] < 1e-4 and "gpu_us" not in r and "host_us" not in r
        assert r["gbs"] == pytest.approx(r["cache_bytes"] / r["us"] / 1e3) and r["of_copy_bw"] == r["gbs"] / 10
    with pytest.raises(ValueError, match="--sweep .* --device cuda"):
        decode_kernels.main("--device cpu --size tiny --attentions tpa --contexts 8 --batches 1 --sweep".split())


@pytest.mark.skipif(torch.cuda.is_available(), reason="refuses --device cuda only where there is no CUDA device")
def test_eval_items_refuses_a_cuda_device_it_does_not_have():
    """The adapter falls back to the CPU for lm-eval's default --device cuda; the benchmark must not
    report CPU numbers for a CUDA run."""
    from t6.bench import eval_items

    with pytest.raises(ValueError, match="--device cuda: no CUDA device here"):
        eval_items.main(["--device", "cuda", "--items", "1"])


def test_eval_items_runs_the_model_on_the_device_and_dtype_asked(tmp_path, monkeypatch):
    from t6.bench import eval_items

    seen = []

    class Spy(eval_items.T6LM):
        def __init__(self, model, **kwargs):
            super().__init__(model=model, **kwargs)
            seen.append({(p.device.type, p.dtype) for p in self.model.parameters()})

    monkeypatch.setattr(eval_items, "T6LM", Spy)
    args = f"--device cpu --dtype bfloat16 --items 2 --repeats 1 --long-context-lines 2 --task-dir {tmp_path / 'a'} "
    rows = eval_items.main((args + f"--long-task-dir {tmp_path / 'b'} --json {tmp_path / 'r.json'}").split())
    assert seen == [{("cpu", torch.bfloat16)}] * 2  # the per-choice and the shared-prefix adapter
    assert [(r["device"], r["dtype"]) for r in rows] == [("cpu", "bfloat16")] * 3
    assert all(r["items_per_s_per_choice"] > 0 and r["items_per_s_shared_prefix"] > 0 for r in rows)


@pytest.mark.slow  # whole-model generation per mechanism (~7 s)
def test_generate_bench_reports_decode_speed_against_the_bandwidth_bound(tmp_path):
    """`t6.bench.generate` on the CPU: a record per mechanism, prompt length and batch, whose bound is the
    weights plus each row's cache at its mean context, read once per step at the given bandwidth."""
    from t6.bench import generate
    from t6.model.facts import kv_bytes_per_token, parameter_count

    out = tmp_path / "generate.json"
    args = "--attentions mha,tpa --size tiny --prompt-lengths 8,16 --batches 1,2 --new-tokens 16 --threads 1"
    threads = torch.get_num_threads()
    try:  # one thread: two on a busy 2-core machine wait on each other for tens of ms
        result = generate.main([*args.split(), "--bandwidth-gbs", "10", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    records = json.loads(out.read_text())["records"]
    assert records == result["records"] and result["bandwidth_gbs"] == 10
    assert [(r["attention"], r["prompt"], r["batch"]) for r in records] == [
        (name, T0, batch) for name in ("mha", "tpa") for T0 in (8, 16) for batch in (1, 2)
    ]
    configs = common.model_configs(["mha", "tpa"], "tiny", block_size=16 + 16 + 1)
    for r in records:
        cfg = configs[r["attention"]]
        weights = parameter_count(cfg) * 4  # fp32
        cache = r["batch"] * (r["prompt"] + 8) * kv_bytes_per_token(cfg, torch.float32)  # mean context
        assert r["weight_bytes"] == weights and r["cache_bytes_per_step"] == cache
        assert r["bound_tokens_per_s"] == pytest.approx(r["batch"] * 10e9 / (weights + cache))
        assert r["fraction_of_bound"] == pytest.approx(r["tokens_per_s"] / r["bound_tokens_per_s"])
        assert r["step"] == "eager" and r["tokens_per_s"] > 0 and r["prefill_ms"] > 0 and r["graph"] is False
        assert r["kernel"] == {"mha": "t6::gqa_decode (C++)", "tpa": "t6::tpa_decode (C++)"}[r["attention"]]
    by = {(r["attention"], r["prompt"], r["batch"]): r for r in records}
    assert by["tpa", 16, 2]["cache_bytes_per_step"] < by["mha", 16, 2]["cache_bytes_per_step"]  # TPA's smaller cache


def test_benchmark_configs_are_parameter_matched_and_reject_unknown_names():
    configs = model_configs(["mha", "mqa", "gqa", "tpa"], "medium")
    assert {name: cfg.n_head for name, cfg in configs.items()} == {"mha": 16, "mqa": 31, "gqa": 30, "tpa": 47}
    with pytest.raises(KeyError, match="no_such_attention"):
        model_configs(["mha", "no_such_attention"], "medium")


def test_benchmarks_run_and_write_their_records(tmp_path):
    import json

    from t6.bench import decode, kv_memory, prefill

    names = "mha,tpa"
    decode.main(
        [
            "--attentions",
            names,
            "--size",
            "tiny",
            "--contexts",
            "32,64",
            "--steps",
            "1",
            "--rounds",
            "1",
            "--warmup",
            "1",
            "--json",
            str(tmp_path / "decode.json"),
        ]
    )
    kv_memory.main(["--attentions", names, "--sizes", "tiny", "--json", str(tmp_path / "kv.json")])
    prefill.main(
        [
            "--attentions",
            names,
            "--size",
            "tiny",
            "--contexts",
            "32",
            "--rounds",
            "1",
            "--json",
            str(tmp_path / "prefill.json"),
        ]
    )
    records = json.loads((tmp_path / "decode.json").read_text())["records"]
    assert {(r["attention"], r["context"]) for r in records} >= {("mha", 32), ("tpa", 64)}
    mha = {r["context"]: r for r in records if r["attention"] == "mha"}
    for r in records:  # tokens/s is the batch over the step's time; ratios are to MHA at the same context
        assert r["tokens_per_s"] == pytest.approx(1e3 * r["batch"] / r["ms_per_token"])
        assert r["speed_vs_mha"] == pytest.approx(r["tokens_per_s"] / mha[r["context"]]["tokens_per_s"])
        # the speed-up the rooflines allow: MHA's bound over this one's, what speed_vs_mha is with both at their bound
        assert r["roofline_vs_mha"] == pytest.approx(mha[r["context"]]["roofline_ms"] / r["roofline_ms"])
    from t6.report.experiments import decode_table

    # each row names the attention kernel its step ran (the profiler's record of one step), none replayed as a graph
    assert {(r["attention"], r["kernel"], r["graph"]) for r in records} == {
        ("mha", "t6::gqa_decode (C++)", False),
        ("tpa", "t6::tpa_decode (C++)", False),
    }
    tpa64 = next(r for r in records if (r["attention"], r["context"]) == ("tpa", 64))
    cell = f"{tpa64['speed_vs_mha']:.2f}× of {tpa64['roofline_vs_mha']:.2f}×, {tpa64['fraction_of_roofline']:.2f})"
    assert cell in decode_table(json.loads((tmp_path / "decode.json").read_text()))
    tpa = next(r for r in records if r["attention"] == "tpa")
    assert tpa["kv_cache_bytes_per_token"] == 4 * (2 + 2) * (tpa["n_head"] + 64)  # fp32 factors, one layer
    kv = {r["attention"]: r for r in json.loads((tmp_path / "kv.json").read_text())["records"]}
    assert kv["mha"]["kv_cache_bytes_per_token"] == 4 * 2 * 2 * 4 * 64  # bf16, 4 layers, 2 h d_h
    assert (
        kv["tpa"]["smaller_than_mha"] == kv["mha"]["kv_cache_bytes_per_token"] / kv["tpa"]["kv_cache_bytes_per_token"]
    )
    assert {r["attention"] for r in json.loads((tmp_path / "prefill.json").read_text())["records"]} == {"mha", "tpa"}


def test_decode_measure_times_given_shapes_past_their_block_size():
    from t6.bench.decode import measure

    base = dict(n_layer=1, d_model=64, head_dim=16, vocab_size=128, block_size=16, n_head=4)
    configs = {
        "mha": ModelConfig(attention="mha", **base),
        "gqa2": ModelConfig(attention="gqa", attention_options={"n_kv_head": 2}, **base),
    }
    records = measure(configs, [40], steps=1, rounds=1, warmup=1, verbose=False)  # context 40 > block 16
    by_name = {r["attention"]: r for r in records}
    assert set(by_name) == {"mha", "gqa2"} and by_name["mha"]["speed_vs_mha"] == 1.0
    assert by_name["gqa2"]["kv_cache_bytes_per_token"] * 2 == by_name["mha"]["kv_cache_bytes_per_token"]
    assert all(r["context"] == 40 for r in records)
    assert by_name["gqa2"]["speed_vs_mha"] == pytest.approx(
        by_name["gqa2"]["tokens_per_s"] / by_name["mha"]["tokens_per_s"]
    )


def test_step_overhead_times_the_hosts_part_of_a_guarded_and_a_replayed_step(tmp_path):
    """t6.bench.step_overhead on the CPU: the compiled step with a backend that runs nothing (dynamo's guards over
    every parameter and cache tensor, which it takes as graph inputs), the decoder's step whose replay runs
    nothing, and the eager step. Each call of a step advances its position: rounds after the first start again
    at the context, so a cache of exactly context + steps + 1 positions is never written past (each round's
    steps would otherwise run on into an index out of bounds, as they did on CUDA)."""
    from t6.bench import step_overhead

    out = tmp_path / "host.json"
    args = ["--attentions", "mha", "--size", "tiny", "--device", "cpu", "--dtype", "float32", "--context", "900"]
    result = step_overhead.main([*args, "--steps", "3", "--rounds", "3", "--json", str(out)])
    (r,) = result["records"]
    model = model_configs(["mha"], "tiny")["mha"]
    assert r["context"] == model.block_size - 3 - 1  # the cache ends one position after the last step's
    built = step_overhead.random_model(model, "cpu", torch.float32)
    params = sum(1 for _ in built.parameters())
    groups = StaticDecoder(built, 1).projection_groups()  # each group's weights read as one stacked copy
    stacked = sum(len(g) - 1 for layer in groups for g in layer.values())
    assert r["graph_inputs"] >= params - stacked + 2 * model.n_layer  # the weights and each layer's K and V caches
    assert r["guards_us"] > 0 and r["replay_us"] > 0 and r["eager_us"] > 0
    assert json.loads(out.read_text())["benchmark"] == "step_overhead"
