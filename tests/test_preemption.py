"""The stop protocol's parts in one process (t6.training.preemption): handlers that only record, the agreement
folded into the step's one host read, and the hand-over to the signal's previous owner with the exit code
schedulers expect. tests/test_faults.py runs it across ranks, launchers and faults."""

from __future__ import annotations

import os
import signal
import stat
import sys
from types import SimpleNamespace

import pytest
import torch

from t6.training.preemption import STOP_SIGNALS, StopSignals, agree_on_step_end, hand_over, stop_signals


@pytest.fixture(autouse=True)
def _handlers_restored():
    """hand_over ignores the stop signals for the rest of a process's life; a test process goes on."""
    saved = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def fake_trainer():
    connector = SimpleNamespace(received_sigterm=False)
    epoch_loop = SimpleNamespace(_skip_next_val=False)
    return SimpleNamespace(world_size=1, _signal_connector=connector, fit_loop=SimpleNamespace(epoch_loop=epoch_loop))


def test_a_signal_is_only_recorded_until_the_step_ends():
    trainer = fake_trainer()
    with stop_signals:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop_signals.requested and not trainer._signal_connector.received_sigterm  # nothing acted on it yet
        assert agree_on_step_end(trainer, torch.tensor(1.5))  # finite
        assert trainer._signal_connector.received_sigterm and trainer.fit_loop.epoch_loop._skip_next_val
        assert stop_signals.agreed == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # the handlers it found are back


def test_the_step_end_reads_the_norm_and_the_request_together():
    trainer = fake_trainer()
    with stop_signals:
        assert not agree_on_step_end(trainer, torch.tensor(float("nan")))
        assert not trainer._signal_connector.received_sigterm
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert not agree_on_step_end(trainer, torch.tensor(float("inf")))
        assert stop_signals.agreed == signal.SIGTERM  # SIGTERM outranks Ctrl-C when both came


def test_a_second_ctrl_c_quits_at_once():
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


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
