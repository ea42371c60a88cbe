"""Never worse off than eager (t6.model.fallback): each accelerator fails for real at its first use on the CPU (inductor
without a C++ compiler, a CUDA graph capture on a machine without CUDA, Liger unimportable, a checkpoint write
that fails, the evaluation's CUDA memory probe without CUDA), and the run warns once naming the setting,
records it (`fallback/<name>` in MLflow) and ends with the eager run's losses and tokens. The Triton kernels'
fallback (a launch out of shared memory) is tested with the kernels, in tests/test_triton_decode.py."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from pathlib import Path

import mlflow
import pytest
import torch
from test_inference import tiny

from t6.model import fallback
from t6.model.loss import linear_cross_entropy, use_liger
from t6.model.static_decode import CudaGraphs, StaticDecoder, auto_decoder
from t6.model.t6 import left_pad

PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 2], [11]]  # left-padded to 7 tokens


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "t6.model.fallback" and r.levelno == logging.WARNING]


def test_an_accelerator_that_fails_warns_once_is_recorded_and_is_not_tried_again(caplog):
    heard = []
    stop = fallback.subscribe(heard.append)
    assert fallback.enabled("liger")
    event = fallback.fell_back("liger", RuntimeError("no kernel for this GPU\n(details)"))
    assert fallback.fell_back("liger", ValueError("a second failure")) is event  # not warned or recorded again
    stop()
    fallback.fell_back("compile", RuntimeError("x"))  # after unsubscribing: not heard
    assert heard == [event] and [e.name for e in fallback.events()] == ["liger", "compile"]
    assert not fallback.enabled("liger") and fallback.enabled("triton_decode")
    (first, _) = warnings_of(caplog)
    assert "Liger-Kernel's fused linear cross-entropy failed at first use" in first
    assert "(RuntimeError: no kernel for this GPU)" in first and "the chunked loss" in first
    assert first.endswith("To skip it from the start: loss_impl=chunked")
    fallback.reset()
    assert fallback.enabled("liger") and fallback.events() == []


def test_t6_eager_turns_accelerators_off_before_they_are_tried(monkeypatch):
    monkeypatch.setenv("T6_EAGER", "triton_decode, liger")
    assert not fallback.enabled("liger") and not fallback.enabled("triton_decode") and fallback.enabled("compile")
    monkeypatch.setenv("T6_EAGER", "all")
    assert not any(fallback.enabled(name) for name in fallback.ACCELERATORS)
    monkeypatch.setenv("T6_EAGER", "cuda_graphs")
    with pytest.raises(ValueError, match="'cuda_graphs' is not one of all, compile, decode_compile"):
        fallback.enabled("compile")
    with pytest.raises(KeyError, match="'graphs' is not an accelerator with a fallback"):
        fallback.fell_back("graphs", RuntimeError())


def mlflow_run(objects) -> mlflow.entities.Run:
    return mlflow.MlflowClient(objects["plan"].tracking.uri).get_run(objects["mlflow"].run_id)


def losses_of(objects) -> list[float]:
    client = mlflow.MlflowClient(objects["plan"].tracking.uri)
    return [m.value for m in client.get_metric_history(objects["mlflow"].run_id, "train/loss")]


@pytest.fixture
def no_cxx(monkeypatch, tmp_path: Path):
    """Inductor without a working C++ compiler, as CXX=/bin/false makes it, and no compiled code to reuse."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    with torch._inductor.config.patch({"cpp.cxx": (None, "/bin/false")}):
        yield
    torch._dynamo.reset()


@pytest.mark.slow  # two short training runs, one of them failing to compile (~25 s)
def test_a_compile_that_fails_trains_on_eagerly_with_the_eager_losses_and_samples(make_cfg, no_cxx):
    from t6.run.train import main as train

    runs = {}
    for compile_ in ("false", "true"):
        cfg = make_cfg(f"compile={compile_}", "trainer.max_steps=3", "samples.max_new_tokens=6")
        runs[compile_] = train(cfg)[1]
    eager, compiled = runs["false"], runs["true"]
    assert compiled["plan"].hardware.compile and not eager["plan"].hardware.compile
    assert losses_of(compiled) == losses_of(eager) and len(losses_of(eager)) == 3
    assert compiled["samples"] == eager["samples"]
    run = mlflow_run(compiled)
    assert run.data.metrics["fallback/compile"] == 1.0 and "InvalidCxxCompiler" in run.data.tags["fallback/compile"]
    assert "fallback/compile" not in mlflow_run(eager).data.metrics


@pytest.mark.slow  # two attempts at compiling a decode step, both failing (~15 s)
def test_a_decode_step_that_fails_to_compile_generates_the_eager_tokens(no_cxx, caplog):
    model = tiny("mha", block_size=64)
    idx, mask = left_pad(PROMPTS)
    decoder = StaticDecoder(model, 3, compile=True)  # inductor: FlexAttention first, then SDPA
    out = model.generate(idx, 10, temperature=0, prompt_mask=mask, decode=decoder)
    assert torch.equal(out, model.generate(idx, 10, temperature=0, prompt_mask=mask, decode="eager"))
    assert [e.name for e in fallback.events()] == ["flex_decode", "decode_compile"]
    assert all("InvalidCxxCompiler" in e.error for e in fallback.events()) and len(warnings_of(caplog)) == 2


@pytest.mark.parametrize("name", ["gqa", "tpa", "mla"])
def test_a_capture_that_fails_decodes_uncaptured_with_the_eager_tokens(name, caplog):
    model = tiny(name, block_size=64)
    idx, mask = left_pad(PROMPTS)
    decoder = StaticDecoder(model, 3, capture=CudaGraphs())  # CUDA graphs on a machine without CUDA: they fail
    out = model.generate(idx, 12, temperature=0, prompt_mask=mask, decode=decoder)
    assert torch.equal(out, model.generate(idx, 12, temperature=0, prompt_mask=mask, decode="eager"))
    assert [e.name for e in fallback.events()] == ["decode_graph"] and len(warnings_of(caplog)) == 1
    assert "T6_EAGER=decode_graph" in warnings_of(caplog)[0]


class CaptureThatRaises:
    """A capture that fails as CUDA's does mid-capture: the step's warm-up runs, then recording it raises (a real
    capture executes nothing, so nothing the step writes has changed)."""

    def __init__(self):
        self.warmups = 0

    @contextlib.contextmanager
    def warmup(self):
        self.warmups += 1
        yield

    def __call__(self, run):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


def test_a_capture_that_raises_decodes_uncaptured_and_the_process_goes_on(caplog):
    """The capture fails after the step's warm-up: that step's logits stand, every later step runs uncaptured
    with the eager path's tokens, the capture is not tried again, and later generations, sampled ones included
    (random numbers drawn after the failure), give what they give without a decoder."""
    model = tiny("tpa", block_size=64)
    idx, mask = left_pad(PROMPTS)
    capture = CaptureThatRaises()
    decoder = StaticDecoder(model, 3, capture=capture)
    out = model.generate(idx, 12, temperature=0, prompt_mask=mask, decode=decoder)
    assert torch.equal(out, model.generate(idx, 12, temperature=0, prompt_mask=mask, decode="eager"))
    assert [e.name for e in fallback.events()] == ["decode_graph"] and capture.warmups == 1
    assert "operation not permitted when stream is capturing" in warnings_of(caplog)[0]
    torch.manual_seed(5)
    sampled = model.generate(idx, 8, temperature=1.0, top_k=20, prompt_mask=mask, decode=decoder)
    torch.manual_seed(5)
    assert torch.equal(sampled, model.generate(idx, 8, temperature=1.0, top_k=20, prompt_mask=mask, decode="eager"))
    assert capture.warmups == 1 and decoder.run.captured == set()


def test_generate_replays_graphs_on_cuda_from_a_few_new_tokens_and_never_compiles_on_its_own():
    assert auto_decoder("cpu", 1000) == "eager"
    assert auto_decoder("cuda", 4) == "eager" and auto_decoder("cuda", 8) == auto_decoder("cuda", 4096) == "static"


def test_loss_impl_auto_never_picks_a_liger_that_is_not_installed(monkeypatch):
    assert use_liger("auto", "cuda") and not use_liger("auto", "cpu")
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # not importable, as on the GPU image
    assert not use_liger("auto", "cuda")
    with pytest.raises(ValueError, match="loss_impl=liger needs Liger-Kernel, which is not installed here"):
        use_liger("liger", "cuda")


def test_liger_failing_at_its_first_call_falls_back_to_the_chunked_loss(monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # where Liger may run on the CPU
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", None)  # its import fails at first call
    torch.manual_seed(0)
    h, weight = torch.randn(24, 16), torch.randn(50, 16)
    targets = torch.randint(0, 50, (24,))
    grads = []
    for impl in ("liger", "chunked"):
        h_, w_ = h.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = linear_cross_entropy(h_, w_, targets, chunk_tokens=8, impl=impl)
        loss.backward()
        grads.append((loss.detach(), h_.grad, w_.grad))
    for fell_back, chunked in zip(*grads):
        assert torch.equal(fell_back, chunked)
    assert [e.name for e in fallback.events()] == ["liger"] and "needs liger-kernel" in fallback.events()[0].error
    assert not use_liger("auto", "cuda")  # not tried again in this process


@pytest.mark.slow  # two short training runs (~20 s)
def test_a_background_checkpoint_write_that_fails_is_written_synchronously(make_cfg, monkeypatch):
    from t6.run.train import main as train
    from t6.training.checkpoint_io import AtomicCheckpointIO

    save, failed = AtomicCheckpointIO.save_checkpoint, []

    def disk_full_once(io, checkpoint, path, storage_options=None):
        if threading.current_thread() is not threading.main_thread() and not failed:
            failed.append(Path(path).name)
            raise OSError(28, "No space left on device")
        save(io, checkpoint, path, storage_options)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", disk_full_once)
    runs, states = {}, {}
    for background in ("false", "true"):
        cfg = make_cfg(f"trainer.plugins.0.background={background}", "trainer.max_steps=8")
        runs[background] = train(cfg)[1]
        last = Path(runs[background]["trainer"].checkpoint_callback.dirpath) / "last.ckpt"
        states[background] = torch.load(last, map_location="cpu", weights_only=True)["state_dict"]
    assert failed == ["step000004.ckpt"]  # the first background write
    assert losses_of(runs["true"]) == losses_of(runs["false"])
    assert all(torch.equal(states["true"][k], v) for k, v in states["false"].items())
    run = mlflow_run(runs["true"])
    assert run.data.metrics["fallback/background_checkpoint"] == 1.0
    assert "No space left on device" in run.data.tags["fallback/background_checkpoint"]
    assert sorted(p.name for p in Path(runs["true"]["trainer"].checkpoint_callback.dirpath).iterdir()) == [
        "last.ckpt",
        "step000008.ckpt",
    ]


def test_an_evaluation_batch_probe_that_fails_evaluates_with_a_fixed_batch(monkeypatch):
    from t6.evaluation.adapter import AUTO_CPU_ROWS, T6LM

    lm = T6LM(model=tiny("mha"), batch_size=4)
    monkeypatch.setattr(lm, "model_device", torch.device("cuda"))  # the probe's CUDA calls, on a machine without CUDA
    if torch.cuda.is_available():
        pytest.skip("the probe would run for real on this machine")
    assert lm.auto_batch_size() == AUTO_CPU_ROWS
    assert [e.name for e in fallback.events()] == ["eval_batch_probe"]
