"""The stop protocol (t6.training.stop) in one process: handlers that only record, the agreement at the end of an
optimizer step (carried by the module's own check where it has one), last.ckpt at that step, the exit, and the
hand-over to the signal's previous owner with the exit code schedulers expect; with a module that overrides the
gradient clipping hook and one that optimizes manually. tests/test_faults.py runs it across ranks, launchers and
faults."""

from __future__ import annotations

import os
import signal
import stat
import sys
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from t6.training.stop import STOP_SIGNALS, RunStopped, StopProtocol, StopSignals, any_rank, hand_over


@pytest.fixture(autouse=True)
def _handlers_restored():
    """hand_over ignores the stop signals for the rest of a process's life; a test process goes on."""
    saved = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


class FakeTrainer(SimpleNamespace):
    """What the protocol reads of a one-process Trainer, recording what it does."""

    def __init__(self, protocol: StopProtocol, **kwargs):
        io = SimpleNamespace(teardown=lambda: self.done.append("io teardown"))
        strategy = SimpleNamespace(checkpoint_io=io, barrier=lambda name=None: self.done.append("barrier"))
        fields = dict(world_size=1, global_step=0, max_steps=10, should_stop=False, sanity_checking=False)
        fields.update(kwargs)
        super().__init__(
            callbacks=[protocol],
            checkpoint_callback=protocol,
            is_global_zero=True,
            strategy=strategy,
            done=[],
            **fields,
        )

    def save_checkpoint(self, path, weights_only=None):  # Trainer.save_checkpoint's signature
        self.done.append(f"save {path} at {self.global_step}")


def test_a_signal_is_only_recorded_until_the_step_ends(tmp_path):
    protocol = StopProtocol(tmp_path / "last.ckpt")
    trainer = FakeTrainer(protocol)
    protocol.signals.install()
    try:
        protocol.on_train_start(trainer, None)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert protocol.signals.requested and protocol.agreed is None  # nothing acted on it yet
        protocol.on_train_batch_end(trainer, None)  # a micro-batch inside the step: nothing read
        assert trainer.done == [] and protocol.agreed is None
        trainer.global_step = 1  # the step ends
        protocol.on_train_batch_end(trainer, None)
        assert protocol.agreed == signal.SIGUSR1 and trainer.should_stop
        assert trainer.done == [f"save {tmp_path / 'last.ckpt'} at 1"]
        with pytest.raises(RunStopped) as stop:
            protocol.on_validation_start(trainer, None)  # the validation should_stop asks for is skipped
        assert trainer.done[1:] == ["io teardown", "barrier"]  # on disk on every rank before any leaves
        assert (stop.value.signum, stop.value.step, stop.value.code) == (signal.SIGUSR1, 1, 128 + signal.SIGUSR1)
    finally:
        protocol.signals.restore()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # the handlers it found are back


def test_the_step_end_reads_the_modules_flag_and_the_request_together(tmp_path):
    protocol = StopProtocol(tmp_path / "last.ckpt")
    trainer = FakeTrainer(protocol)
    protocol.signals.install()
    try:
        assert any_rank(trainer, torch.isfinite(torch.tensor(float("nan"))).logical_not())
        assert protocol.answer == 0
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert not any_rank(trainer, torch.isfinite(torch.tensor(1.0)).logical_not())
        assert protocol.answer == STOP_SIGNALS.index(signal.SIGTERM) + 1  # SIGTERM outranks Ctrl-C when both came
        trainer.global_step = 1
        protocol.on_train_batch_end(trainer, None)
        assert protocol.agreed == signal.SIGTERM and protocol.answer is None
    finally:
        protocol.signals.restore()


def test_a_stop_at_the_last_step_lets_the_run_end(tmp_path):
    protocol = StopProtocol(tmp_path / "last.ckpt")
    trainer = FakeTrainer(protocol, max_steps=1)
    protocol.signals.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        trainer.global_step = 1
        protocol.on_train_batch_end(trainer, None)
        protocol.on_validation_start(trainer, None)  # the final validation runs
        assert protocol.agreed is None and trainer.done == [] and not trainer.should_stop
    finally:
        protocol.signals.restore()


def test_a_second_ctrl_c_quits_at_once():
    stop = StopSignals()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.restore()


def test_after_a_failure_the_launchers_sigterm_is_recorded_until_the_run_has_said_where_it_stopped(tmp_path):
    protocol = StopProtocol(tmp_path / "last.ckpt")
    trainer = FakeTrainer(protocol)
    found = signal.getsignal(signal.SIGTERM)
    protocol.signals.install()
    try:
        protocol.on_exception(trainer, None, RuntimeError("Connection closed by peer"))  # a peer was SIGKILLed
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun's agent stops the others: recorded, not the default's exit
        assert protocol.signals.requested == STOP_SIGNALS.index(signal.SIGTERM) + 1
    finally:
        protocol.signals.restore()  # what t6.run.execute does once its failure note and MLflow tags are out
    assert signal.getsignal(signal.SIGTERM) == found
    protocol.signals.install()
    protocol.on_exception(trainer, None, RunStopped(signal.SIGTERM, 1, "last.ckpt"))
    assert signal.getsignal(signal.SIGTERM) == found  # a stop's exit restores at once: hand_over finds them


class Toy(L.LightningModule):
    """A linear regression, for the protocol's runs with modules other than T6's."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
        return torch.utils.data.DataLoader(data, batch_size=4)


class ClipsItself(Toy):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)


class OptimizesManually(Toy):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizer.step()


class SignalAt(L.Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("module", [ClipsItself, OptimizesManually], ids=["clips-itself", "manual-optimization"])
def test_the_protocol_stops_any_module(module, tmp_path, monkeypatch):
    """A module that overrides the gradient clipping hook, or optimizes manually, reads nothing at the step's end:
    the protocol agrees on its own there (once per optimizer step, never per micro-batch), saves last.ckpt at the
    first step end after the signal and stops."""
    agreements = []
    agree = StopProtocol.agree
    monkeypatch.setattr(
        StopProtocol, "agree", lambda self, trainer: agreements.append(trainer.global_step) or agree(self, trainer)
    )
    path = tmp_path / "last.ckpt"
    accumulate = 2 if module is ClipsItself else 1  # manual optimization accumulates as its training_step says
    trainer = L.Trainer(
        max_steps=20,
        accelerator="cpu",
        callbacks=[SignalAt(3), StopProtocol(path)],
        accumulate_grad_batches=accumulate,
        gradient_clip_val=1.0 if module is ClipsItself else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    with pytest.raises(RunStopped) as stop:
        trainer.fit(module())
    # the signal came in step 3's end hooks, before the protocol's: agreed there
    assert stop.value.step == trainer.global_step == 3 and stop.value.signum == signal.SIGTERM
    assert torch.load(path, weights_only=True)["global_step"] == 3
    assert agreements == [1, 2, 3]  # one per optimizer step


@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_hand_over_exits_128_plus_the_signal(signum):
    with pytest.raises(SystemExit) as exit_:
        hand_over(signum)
    assert exit_.value.code == 128 + signum


def test_hand_over_gives_the_signal_to_its_previous_owner_after_the_save():
    seen = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))
    try:
        with pytest.raises(SystemExit) as exit_:
            hand_over(signal.SIGUSR2)
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert seen == [signal.SIGUSR2] and exit_.value.code == 140
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # a launcher's SIGTERM cannot cut the exit short


def test_hand_over_requeues_a_slurm_job_on_lightnings_requeue_signal(tmp_path, monkeypatch):
    from lightning.fabric.plugins.environments import SLURMEnvironment

    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/called\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(sys, "argv", ["srun"])
    for key, value in {
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "t6",
    }.items():
        monkeypatch.setenv(key, value)
    environment = SLURMEnvironment()  # auto_requeue on SIGUSR1, as Lightning's default
    with pytest.raises(SystemExit) as exit_:
        hand_over(signal.SIGUSR1, environment)
    assert (tmp_path / "called").read_text() == "requeue 4242\n" and exit_.value.code == 138
    with pytest.raises(SystemExit):
        hand_over(signal.SIGTERM, environment)  # not its requeue signal
    assert (tmp_path / "called").read_text() == "requeue 4242\n"
