"""An operator's pause / resume / stop through Colocation.operator: the reply says the true
state (409 for an action the state refuses), pause gives the lent KV memory back (unless
configured not to), stop gives every chunk back and lends no more. The memory moves on
the engine thread, at its next idle tick."""

from __future__ import annotations

import types

import pytest

from harvest.colocate.colocation import Colocation
from harvest.colocate.step_timer import CpuStepTimer
from harvest.schedule import TrainerState


class Host:
    def __init__(self, state=TrainerState.RUNNING):
        self.state, self.calls = state, []
        self.on_unit = self.on_fault = self.on_job_end = None
        self.runs = ["job"]  # one job configured

    def status(self):
        return types.SimpleNamespace(state=self.state)

    def operator_pause(self):
        self.calls.append("pause")

    def operator_resume(self):
        self.calls.append("resume")

    def operator_stop(self):
        self.calls.append("stop")


class Lending:
    num_lent = 0

    def __init__(self):
        self.calls = []

    def return_all(self):
        self.calls.append("return")

    def resume_lending(self):
        self.calls.append("resume")

    def maybe_lend(self, force=False):
        pass

    def maybe_check_integrity(self):
        return False


def colocation(host, release_on_pause=True):
    config = types.SimpleNamespace(memory=types.SimpleNamespace(release_on_pause=release_on_pause),
                                   trainer=types.SimpleNamespace(cpu_threads=1, nice=2))
    control = types.SimpleNamespace(on_idle=lambda: None, forget_unmeasured=lambda: None, after_step=None)
    return Colocation(config=config, partitioner=None, step_controller=control, trainer_host=host, lending=Lending(),
                      timer=CpuStepTimer(), metrics=None, refiner=None)


def test_pause_returns_the_memory_resume_lends_again_on_the_engine_thread():
    host = Host()
    colo = colocation(host)
    code, reply = colo.operator("pause")
    assert (code, reply["trainer"]) == (200, "paused") and host.calls == ["pause"]
    assert colo.lending.calls == []  # not on the control endpoint's thread
    colo.on_idle()
    assert colo.lending.calls == ["return"]
    assert colo.operator("resume")[0] == 200
    colo.on_idle()
    assert colo.lending.calls == ["return", "resume"] and host.calls == ["pause", "resume"]


def test_a_pause_that_keeps_the_memory_when_configured():
    colo = colocation(Host(), release_on_pause=False)
    code, reply = colo.operator("pause")
    colo.on_idle()
    assert code == 200 and reply["kv"] == "kept" and colo.lending.calls == []


def test_stop_ends_lending_and_refuses_what_comes_after():
    host = Host()
    colo = colocation(host)
    assert colo.operator("stop")[0] == 200
    colo.on_idle()
    assert colo.lending.calls == ["return"] and host.calls == ["stop"]
    for action in ("resume", "pause", "stop"):
        code, reply = colo.operator(action)
        assert code == 409 and "error" in reply, action
    colo.on_idle()
    assert colo.lending.calls == ["return"]  # a refused resume lends nothing
    host.state = TrainerState.STOPPED  # once the trainer has checkpointed and left
    assert colo.operator("resume")[0] == 409


@pytest.mark.parametrize("state", [TrainerState.FINISHED, TrainerState.FAILED, TrainerState.STOPPED])
def test_an_ended_trainer_refuses_every_action(state):
    colo = colocation(Host(state))
    for action in ("pause", "resume", "stop"):
        code, reply = colo.operator(action)
        assert code == 409 and reply["trainer"] == state.value
    assert colo.trainer_host.calls == []


def test_without_a_job_every_action_is_refused():
    colo = colocation(None)
    assert colo.operator("pause") == (409, {"error": "no finetune job configured"})


@pytest.mark.parametrize(("live", "lends_again"), [(True, True), (False, False)])
def test_one_jobs_fault_takes_the_memory_back_and_the_other_jobs_get_it_again(live, lends_again):
    host = Host()
    host.live = live  # another job still queued or running
    colo = colocation(host)
    colo.lending.enabled = True
    colo.lending.reclaim_all = lambda: (colo.lending.calls.append("reclaim_all"),
                                        setattr(colo.lending, "enabled", False))
    colo._on_trainer_fault(RuntimeError("one job's OOM"))
    colo.on_idle()
    assert colo.lending.calls[0] == "reclaim_all"
    assert colo.lending.enabled is lends_again
    assert (colo.lending.calls[1:] == ["resume"]) is lends_again
