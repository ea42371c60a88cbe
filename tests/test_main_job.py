"""The main job (`make run`: train.py with no overrides) learns: its validation loss falls far below a
fresh model's ln(50304) = 10.8, it beats chance on the held-out cloze by more than three standard errors, and
far above chance on the local next-line task, where a fresh model of its shape does not. The run is the default
config itself; only where it writes and MLflow are changed."""

import pytest
import torch

from t6.evaluation.next_line import TASK, build_next_line_task
from t6.evaluation.runner import EvalSpec, resolve_tasks, run_harness
from t6.model import T6
from t6.run.train import main as train

from conftest import compose_config

CHANCE = 0.25  # four choices


@pytest.mark.slow  # the main job itself: ~2.5 min of training and ~30 s of evaluation on 2 cores
def test_main_job_learns_and_beats_chance_on_the_cloze_and_the_next_line(tmp_path, shared_data_dir):
    overrides = ["logger=none", "eval.num_fewshot=[0]", f"paths.data_dir={shared_data_dir}", "trainer.accelerator=cpu"]
    cfg = compose_config(overrides, tmp_path)  # the CPU's numbers, on a CUDA machine too
    assert cfg.trainer.max_steps == 160 and cfg.size.name == "tiny" and cfg.attention.name == "tpa"
    assert cfg.size.d_model == 128
    metrics, objects = train(cfg)
    assert metrics["val/loss"] < 5.8, metrics  # measured 5.61 (fp32); 256 wide: 5.79; fresh: 10.8, unigram: 6.5
    acc, stderr = metrics["eval/0shot/t6_cloze/acc"], metrics["eval/0shot/t6_cloze/acc_stderr"]
    assert acc > CHANCE + 3 * stderr, (acc, stderr)  # measured 0.328 +- 0.012 over 1,600 items
    assert objects["samples"], "the closing summary's greedy samples"

    trained = objects["model"].model  # the trained model through the harness, beside a fresh one of its shape
    torch.manual_seed(0)
    fresh = T6(trained.cfg)
    include = build_next_line_task(tmp_path / "task", n_test=100, n_fewshot=4)
    spec = EvalSpec(tasks=[TASK], num_fewshot=[0], metrics={TASK: "acc_norm"}, include_path=[str(include)])
    tm = resolve_tasks(spec)
    next_line = {
        name: run_harness(m, spec, tm)[0]["results"][TASK]["acc_norm,none"]
        for name, m in [("trained", trained), ("fresh", fresh)]
    }
    # 100 items, chance 0.25 (binomial sd 0.043): trained far above, fresh within chance
    assert next_line["trained"] > 0.5 and next_line["fresh"] < 0.4, next_line
