"""Downstream evaluation: the lm-eval adapter's scores, the embedded task, the callback, eval.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlflow
import pytest
import torch
import torch.nn.functional as F

from t6.errors import SettingError, Unreachable
from t6.evaluation.adapter import T6LM
from t6.evaluation.next_line import TASK, build_next_line_task
from t6.evaluation.runner import EvalSpec, resolve_tasks, run_harness
from t6.model import T6, ModelConfig
from t6.model.attention import available
from t6.run.closing import closing_summary
from t6.run.train import main as train

from conftest import ROOT

SMALL_TASK = [
    f"eval.local_tasks.{t}.{k}={v}" for t in ("t6_next_line", "t6_cloze") for k, v in (("n_test", 12), ("n_fewshot", 4))
]


def random_model(block_size: int = 64, seed: int = 0, attention: str = "mha") -> T6:
    torch.manual_seed(seed)
    model = T6(
        ModelConfig(
            vocab_size=50304, block_size=block_size, n_layer=2, d_model=64, n_head=4, head_dim=16, attention=attention
        )
    )
    with torch.no_grad():
        for p in model.parameters():  # leave the zero-initialized branches non-trivial
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def direct_logprob(model: T6, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    full = (ctx + cont)[-(model.cfg.block_size + 1) :]
    device = next(model.parameters()).device  # the model's own device (a CUDA model in the cuda tests)
    logits = model(torch.tensor([full[:-1]], device=device))[0]  # [T, vocab]
    lp = F.log_softmax(logits[-len(cont) :].double(), dim=-1)  # [len(cont), vocab]
    target = torch.tensor(cont, device=device)
    return float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())


def test_loglikelihood_equals_model_logprob_including_long_contexts():
    model = random_model(block_size=64)
    lm = T6LM(model=model, batch_size=3)
    # lm_eval's --batch_size forms: N, "N", auto, auto:N (auto on the CPU: 16)
    assert [T6LM(model=model, batch_size=b).batch_size for b in ("8", "auto", "auto:4", None)] == [8, 16, 16, 16]
    g = torch.Generator().manual_seed(1)
    requests = []
    for ctx_len, cont_len in [(5, 1), (30, 4), (63, 1), (100, 7), (250, 12), (1, 64)]:  # some beyond block_size
        ctx = torch.randint(0, 50257, (ctx_len,), generator=g).tolist()
        cont = torch.randint(0, 50257, (cont_len,), generator=g).tolist()
        requests.append((ctx, cont))
    # a continuation that is the model's own greedy choice
    ctx = requests[3][0]
    with torch.no_grad():
        greedy = [int(model(torch.tensor([ctx[-64:]]))[0, -1].argmax())]
    requests.append((ctx, greedy))
    got = lm._loglikelihood_tokens([(None, c, k) for c, k in requests])
    with torch.no_grad():
        want = [direct_logprob(model, c, k) for c, k in requests]
    for (lp, is_greedy), (lp_ref, greedy_ref) in zip(got, want):
        assert lp == pytest.approx(lp_ref, abs=1e-3)
        assert is_greedy == greedy_ref
    assert got[-1][1] is True and not any(g for _, g in got[:-1] if g is None)

    # through the string interface: the continuation is the text after the context
    instances = [SimpleNamespace(args=("To be, or not", " to be")), SimpleNamespace(args=("", "Hello world"))]
    lp_str = lm.loglikelihood(instances, disable_tqdm=True)
    enc = lm.tokenizer
    ctx, whole = enc.encode("To be, or not"), enc.encode("To be, or not to be")
    with torch.no_grad():
        assert lp_str[0][0] == pytest.approx(direct_logprob(model, ctx, whole[len(ctx) :])[0], abs=1e-3)
        assert lp_str[1][0] == pytest.approx(direct_logprob(model, [50256], enc.encode("Hello world"))[0], abs=1e-3)


class RecordingCacheHook:
    """Stands in for lm-eval's CacheHook: what the adapter hands it, in order."""

    def __init__(self):
        self.calls = []

    def add_partial(self, kind, key, value):
        self.calls.append((kind, key, value))


@pytest.mark.parametrize("attention", available())
def test_shared_prefix_scores_equal_per_choice_scores(attention):
    """Prefilling a context once for all its continuations gives the per-choice path's answers, in the
    requests' order, for contexts of different lengths batched together (left-padded, or batched by
    length for attentions without padding masks) and contexts truncated differently per continuation."""
    model = random_model(block_size=64, attention=attention)
    g = torch.Generator().manual_seed(2)
    requests = []
    for n, ctx_len in enumerate([9, 20, 20, 3, 47, 80, 1]):  # 80: each continuation truncates it differently
        ctx = torch.randint(0, 50257, (ctx_len,), generator=g).tolist()
        for k in range(4):
            cont = torch.randint(0, 50257, (1 + (n + k) % 5,), generator=g).tolist()
            requests.append(((f"item {n}", f"choice {k}"), ctx, cont))
    ctx = requests[4][1]
    with torch.no_grad():  # one continuation that is the model's own greedy choice: is_greedy is True for it
        greedy = model.generate(torch.tensor([ctx]), 3, temperature=0.0)[0, len(ctx) :].tolist()
    requests.insert(6, (("item 4", "greedy"), ctx, greedy))
    requests.append((None, [5, 6, 7], [8, 9]))  # no key: not handed to the cache hook (rolling windows)
    order = torch.randperm(len(requests), generator=g).tolist()  # interleave the items' choices
    requests = [requests[i] for i in order]

    answers = {}
    for share_prefix in (True, False):
        lm = T6LM(model=model, batch_size=6, share_prefix=share_prefix)
        lm.cache_hook = RecordingCacheHook()
        answers[share_prefix] = lm._loglikelihood_tokens(requests, disable_tqdm=True)
        keyed = [(key, answer) for (key, _, _), answer in zip(requests, answers[share_prefix]) if key is not None]
        assert sorted(lm.cache_hook.calls) == sorted(("loglikelihood", key, answer) for key, answer in keyed)
    for (lp, is_greedy), (lp_ref, greedy_ref) in zip(answers[True], answers[False], strict=True):
        assert lp == pytest.approx(lp_ref, abs=1e-4)
        assert is_greedy == greedy_ref
    assert answers[True][order.index(6)][1] is True


def test_shared_prefix_batches(monkeypatch):
    """Batches hold at most batch_size continuations, fit the block when left-padded, and mix prefix
    lengths only for attentions with padding masks."""
    requests = (
        [(None, [1] * 40, [2] * 4)] * 3  # 0-2: one prefix of 39 tokens, a 4-token tail
        + [(None, [3] * 20, [2])]  # 3: prefix 19, tail 1
        + [(None, [1] * 10, [2] * 30), (None, [3] * 10, [2])]  # 4: prefix 9, tail 30; 5: prefix 9, tail 1
        + [(None, [4, 4], [5])] * 6
    )  # 6-11: one prefix, more continuations than batch_size
    masked = T6LM(model=random_model(block_size=64), batch_size=5)
    # 4 joins 0-3 in rows but 39 + 30 tokens exceed the block
    assert masked._prefix_batches(requests) == [[[0, 1, 2], [3]], [[4], [5]], [[6, 7, 8, 9, 10]], [[11]]]
    unmasked_model = random_model(block_size=64, attention="tpa_shared_b")
    monkeypatch.setattr(type(unmasked_model.blocks[0].attn), "supports_key_mask", False)  # an attention without them
    unmasked = T6LM(model=unmasked_model, batch_size=5)
    assert masked.padding_masks and not unmasked.padding_masks
    assert unmasked._prefix_batches(requests) == [[[0, 1, 2]], [[3]], [[4], [5]], [[6, 7, 8, 9, 10]], [[11]]]
    with pytest.raises(ValueError, match="share_prefix='no' must be true or false"):
        T6LM(model=masked.model, share_prefix="no")
    with pytest.raises(ValueError, match="at least one context token"):
        masked._loglikelihood_tokens([(None, [], [1])])


def test_rolling_and_generate():
    model = random_model(block_size=32)
    lm = T6LM(model=model)
    text = "Now is the winter of our discontent made glorious summer by this sun of York. " * 3
    tokens = lm.tok_encode(text)
    with torch.no_grad():  # the first window scores tokens[:32] from EOT, the next ones keep one token of context
        lp = F.log_softmax(model(torch.tensor([[50256] + tokens[:31]]))[0].double(), -1)
        first = float(lp.gather(-1, torch.tensor(tokens[:32])[:, None]).sum())
    total = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))], disable_tqdm=True)[0]
    assert len(tokens) > 32 and total < first < 0

    out = lm.generate_until(
        [SimpleNamespace(args=("Now is the", {"until": ["\n"], "max_gen_toks": 5}))], disable_tqdm=True
    )
    ctx = lm.tok_encode("Now is the")
    with torch.no_grad():
        ref = model.generate(torch.tensor([ctx]), 5, temperature=0.0)[0, len(ctx) :].tolist()
    expected = (
        lm.tok_decode(ref).split("\n")[0] if 50256 not in ref else lm.tok_decode(ref[: ref.index(50256)]).split("\n")[0]
    )
    assert out == [expected]


def test_next_line_task_is_built_deterministically(tmp_path):
    a = build_next_line_task(tmp_path / "a", n_test=30, n_fewshot=6)
    b = build_next_line_task(tmp_path / "b", n_test=30, n_fewshot=6)
    assert (a / "test.jsonl").read_text() == (b / "test.jsonl").read_text()
    import json

    test = [json.loads(x) for x in (a / "test.jsonl").read_text().splitlines()]
    few = [json.loads(x) for x in (a / "fewshot.jsonl").read_text().splitlines()]
    assert len(test) == 30 and len(few) == 6
    assert {it["passage"] for it in test}.isdisjoint(
        it["passage"] for it in few
    )  # few-shot examples are not test items
    for it in test:
        assert len(it["choices"]) == 4 and len(set(it["choices"])) == 4 and 0 <= it["label"] < 4
    assert str(a / "test.jsonl") in (a / f"{TASK}.yaml").read_text()  # absolute data_files


def test_simple_evaluate_on_local_task_is_reproducible(tmp_path):
    include = build_next_line_task(tmp_path / "task", n_test=16, n_fewshot=4)
    spec = EvalSpec(tasks=[TASK], num_fewshot=[0, 2], metrics={TASK: "acc_norm"}, include_path=[str(include)])
    tm = resolve_tasks(spec)
    model = random_model(block_size=256)
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    first = run_harness(model, spec, tm)
    after = torch.rand(3)
    assert torch.equal(before, after)  # the global RNG is untouched
    second = run_harness(model, spec, tm)
    for n in (0, 2):
        r1, r2 = first[n]["results"][TASK], second[n]["results"][TASK]
        assert {"acc,none", "acc_norm,none"} <= set(r1)
        assert (r1["acc,none"], r1["acc_norm,none"]) == (r2["acc,none"], r2["acc_norm,none"])


def loss_history(client, run_id):
    return [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")]


@pytest.mark.slow  # two training runs, one evaluated (~9 s)
def test_callback_logs_to_mlflow_and_leaves_training_unchanged(make_cfg):
    with_eval = make_cfg(*SMALL_TASK, "eval.every_n_steps=4", "eval.limit=6")
    metrics, obj = train(with_eval)
    client = mlflow.MlflowClient(tracking_uri=with_eval.logger.mlflow.tracking_uri)
    run_id = obj["mlflow"].run_id
    for n in (0, 2):
        for name in (f"eval/{n}shot/{TASK}/acc", f"eval/{n}shot/{TASK}/acc_norm", f"eval/{n}shot/avg"):
            assert [m.step for m in client.get_metric_history(run_id, name)] == [4, 8], name
        avg = client.get_metric_history(run_id, f"eval/{n}shot/avg")
        norm = client.get_metric_history(run_id, f"eval/{n}shot/{TASK}/acc_norm")
        cloze = client.get_metric_history(run_id, f"eval/{n}shot/t6_cloze/acc")
        # the average is over the tasks, each by its metric of conf/eval/local.yaml
        assert [m.value for m in avg] == pytest.approx([(a.value + b.value) / 2 for a, b in zip(norm, cloze)])
    artifacts = {a.path for a in client.list_artifacts(run_id, "eval/step000008")}
    assert {"eval/step000008/results.json", "eval/step000008/table.md"} <= artifacts
    assert obj["model"].training  # back in train mode
    assert metrics["eval/2shot/avg"] == avg[-1].value
    assert "eval/2shot/avg" in closing_summary(metrics, obj)  # the run's closing lines

    without = make_cfg("eval=none")
    _, obj2 = train(without)
    assert loss_history(client, obj2["mlflow"].run_id) == loss_history(client, run_id)


def test_unreachable_dataset_fails_before_training(make_cfg, tmp_path, monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as with HF_HUB_OFFLINE=1: no network wait
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "remote.yaml").write_text(
        "task: t6_remote\ndataset_path: t6-lab/no-such-dataset\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{q}}'\ndoc_to_choice: choices\ndoc_to_target: label\n"
    )
    cfg = make_cfg("eval.tasks=[t6_remote]", f"eval.include_path=[{tasks}]")
    with pytest.raises(Unreachable, match="(?s)t6_remote.*HF_DATASETS_OFFLINE"):
        train(cfg)
    assert not (tmp_path / "run").exists()


@pytest.fixture
def default_index(monkeypatch) -> list:
    """Every TaskManager built with lm-eval's own tasks (include_defaults=True: an index of ~14,000 task files, tens
    of seconds): recorded, and built as usual."""
    from lm_eval.tasks import TaskManager

    built, init = [], TaskManager.__init__

    def recorded(self, *args, **kwargs):
        built.append(kwargs.get("include_defaults", True))
        init(self, *args, **kwargs)

    monkeypatch.setattr(TaskManager, "__init__", recorded)
    return built


def test_an_unknown_task_fails_before_training_without_indexing_lm_evals_tasks(make_cfg, tmp_path, default_index):
    cfg = make_cfg("eval.tasks=[hellaswagg]")
    with pytest.raises(SettingError, match="hellaswagg.*did you mean.*hellaswag"):
        train(cfg)
    assert not (tmp_path / "run").exists()
    assert True not in default_index  # said from the task files' text in a second, not after the index (~110 s)


def test_lm_evals_tasks_without_the_hub_fail_in_seconds_naming_the_offline_settings(
    make_cfg, tmp_path, monkeypatch, default_index
):
    """eval=paper on a machine that cannot reach the Hugging Face Hub (here: its endpoint a closed local port) and
    without HF_HUB_OFFLINE: refused before the index and the datasets' retries (it took ~80 s), naming the fix."""
    import huggingface_hub.constants

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # as HF_ENDPOINT would set it
    cfg = make_cfg("eval=paper")
    with pytest.raises(Unreachable, match="cannot reach .127.0.0.1: .*set HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1"):
        train(cfg)
    assert True not in default_index and not (tmp_path / "run").exists()


@pytest.mark.slow  # eval.py and lm-eval's CLI in processes of their own (~15 s)
def test_eval_py_logs_into_training_run_and_lm_eval_cli_runs(make_cfg, tmp_path):
    cfg = make_cfg("eval=none", "trainer.max_steps=4")
    _, obj = train(cfg)
    ckpt = Path(obj["trainer"].checkpoint_callback.dirpath) / "last.ckpt"

    from t6.evaluation.evaluate import evaluate_checkpoint

    ecfg = make_cfg(
        *SMALL_TASK, f"ckpt_path={ckpt}", "run_id=train", "eval.num_fewshot=[0]", config_name="evaluate", small=False
    )
    ecfg.tracking_uri = cfg.logger.mlflow.tracking_uri
    metrics, run_id = evaluate_checkpoint(ecfg)
    assert run_id == obj["mlflow"].run_id
    client = mlflow.MlflowClient(tracking_uri=cfg.logger.mlflow.tracking_uri)
    hist = client.get_metric_history(run_id, f"eval/0shot/{TASK}/acc_norm")
    assert [m.step for m in hist] == [4] and hist[0].value == metrics[f"eval/0shot/{TASK}/acc_norm"]

    # lm-eval's own command line, with the t6 model registered by `python -m t6.evaluation`; the
    # project's local task found without --include_path, the adapter's batch size by default
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "t6.evaluation",
            "--model",
            "t6",
            "--model_args",
            f"checkpoint={ckpt}",
            "--tasks",
            TASK,
            "--limit",
            "4",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src"), "T6_ROOT": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert TASK in proc.stdout and "acc_norm" in proc.stdout and "batch_size: 16" in proc.stdout
    assert (tmp_path / "data" / "eval" / TASK / f"{TASK}.yaml").is_file()


def test_lm_eval_cli_defaults_and_entry_point(tmp_path):
    import tomllib

    from t6.evaluation.__main__ import cli_args

    include = str(tmp_path / "data" / "eval")
    assert cli_args(["--model", "t6", "--tasks", f"{TASK},t6_cloze"], tmp_path) == [
        "--model",
        "t6",
        "--tasks",
        f"{TASK},t6_cloze",
        "--include_path",
        include,
        "--batch_size",
        "16",
    ]
    assert (tmp_path / "data" / "eval" / "t6_cloze" / "t6_cloze.yaml").is_file()  # each named local task is built
    given = ["--tasks=hellaswag", "-b", "8", "--include_path", "/x"]
    assert cli_args(given, tmp_path) == given  # the user's choices stay; other tasks need no local build
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["lm_eval.models"] == {"t6": "t6.evaluation.adapter:T6LM"}


def test_auto_batch_size_is_the_rows_the_memory_left_holds():
    from t6.evaluation.adapter import AUTO_MAX_ROWS, AUTO_MEMORY_SHARE, rows_that_fit

    gib = 2**30
    assert rows_that_fit(20 * gib, gib / 4) == AUTO_MEMORY_SHARE * 80 == 64
    assert rows_that_fit(10 * gib, 20 * gib) == 1  # at least one row: the evaluation then says what is missing
    assert rows_that_fit(1000 * gib, 1) == AUTO_MAX_ROWS


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures CUDA memory")
def test_auto_batch_size_on_cuda_measures_a_scoring_pass():
    model = random_model(block_size=64).cuda()
    lm = T6LM(model=model, batch_size="auto")
    assert 16 <= lm.batch_size <= 256  # a tiny model on a GPU: many rows
    assert lm.loglikelihood_rolling  # the probe left the model usable
    ctx, cont = [1, 2, 3], [4, 5]
    got = lm._loglikelihood_tokens([(None, ctx, cont)])[0]
    assert got[0] == pytest.approx(direct_logprob(model, ctx, cont)[0], abs=1e-3)


def test_progress_bars_stay_out_of_non_terminal_output():
    code = (
        "from t6.cli import quiet_progress_bars; quiet_progress_bars(); import tqdm; "
        "[None for _ in tqdm.tqdm(range(3), desc='building contexts')]"
    )
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("TQDM_DISABLE", None)
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    loud = subprocess.run(
        [sys.executable, "-c", code.split("; ", 2)[-1]], capture_output=True, text=True, env=env, timeout=120
    )
    assert quiet.returncode == loud.returncode == 0
    assert "building contexts" in loud.stderr and "building contexts" not in quiet.stderr
