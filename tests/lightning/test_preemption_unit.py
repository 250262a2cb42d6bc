"""The preemption handler's own parts: the grace clock, the configuration checks, SLURM's requeue."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest

from nereus_lightning.lightning import preemption
from nereus_lightning.spec.errors import NereusConfigError


@pytest.fixture
def state(monkeypatch):  # noqa: ANN201
    """A fresh handler state for the test (the process's own is left alone)."""
    fresh = preemption._State()
    monkeypatch.setattr(preemption, "STATE", fresh)
    return fresh


def test_a_signal_is_recorded_once_and_the_grace_clock_runs_out(state):
    ran: list[float] = []
    state.grace_s, state.on_grace_out = 0.2, lambda: ran.append(time.monotonic())
    previous = preemption.install((signal.SIGUSR1,))
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # a second one changes nothing
        time.sleep(0.6)
    finally:
        preemption.restore(previous)
    assert state.signum == signal.SIGUSR1 and len(ran) == 1 and ran[0] - state.at >= 0.2


def test_the_settings_are_checked_naming_their_keys():
    with pytest.raises(NereusConfigError, match=r"preemption\.step_in_flight: 'later' is not one of"):
        preemption.Preemption(step_in_flight="later")
    with pytest.raises(NereusConfigError, match=r"preemption\.grace_s: must be > 0 seconds"):
        preemption.Preemption(grace_s=0)


def test_slurms_requeue_signal_requeues_the_job_after_the_save(monkeypatch):
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from nereus_lightning.lightning import NereusStrategy

    calls: list[list[str]] = []
    monkeypatch.setattr(preemption.subprocess, "call", lambda args: calls.append(args) or 0)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    env = SLURMEnvironment(auto_requeue=True)
    trainer = SimpleNamespace(strategy=NereusStrategy(cluster_environment=env))
    callback = preemption.Preemption()
    assert callback._requeues(trainer, signal.SIGUSR1) and not callback._requeues(trainer, signal.SIGTERM)
    assert not preemption.Preemption(requeue=False)._requeues(trainer, signal.SIGUSR1)
    preemption.requeue_slurm_job()
    assert calls == [["scontrol", "requeue", "4242"]]
