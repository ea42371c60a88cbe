"""The main job (`make run`: train.py with no overrides) learns: its validation loss falls far below a
fresh model's ln(50304) = 10.8 and it beats chance on the held-out cloze by more than three standard
errors. The run is the default config itself; only where it writes and MLflow are changed."""

import pytest

from t6.run.train import main as train

from conftest import compose_config

CHANCE = 0.25  # four choices


@pytest.mark.slow  # the main job itself: ~3.5 min of training and ~30 s of evaluation on 2 cores
def test_main_job_learns_and_beats_chance_on_the_cloze(tmp_path, shared_data_dir):
    overrides = ["logger=none", "eval.num_fewshot=[0]", f"paths.data_dir={shared_data_dir}", "trainer.accelerator=cpu"]
    cfg = compose_config(overrides, tmp_path)  # the CPU's numbers, on a CUDA machine too
    assert cfg.trainer.max_steps == 160 and cfg.size.name == "tiny" and cfg.attention.name == "tpa"
    assert cfg.size.d_model == 128
    metrics, objects = train(cfg)
    assert metrics["val/loss"] < 5.8, metrics  # measured 5.61 (fp32); 256 wide: 5.79; fresh: 10.8, unigram: 6.5
    acc, stderr = metrics["eval/0shot/t6_cloze/acc"], metrics["eval/0shot/t6_cloze/acc_stderr"]
    assert acc > CHANCE + 3 * stderr, (acc, stderr)  # measured 0.328 +- 0.012 over 1,600 items
    assert objects["samples"], "the closing summary's greedy samples"
