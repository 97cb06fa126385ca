"""TrainerHost without a server: the trainer thread's CPU threads, faults, operator stop."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from harvest.colocate import TrainerHost
from harvest.schedule import TrainerState


class FakeTrainer:
    """Runs units through the gate until stopped; records the thread's torch threads and nice."""

    total_steps = 10

    def __init__(self):
        self.global_step = 0
        self.units = 0
        self.threads_seen = []
        self.nice_seen = []
        self.checkpointed = False

    def stats(self):
        from harvest.train.stats import TrainerStats

        fields = {**{f: 0 for f in TrainerStats.__dataclass_fields__}, "fleet": None}
        return TrainerStats(**{**fields, "state": "running", "loss": None, "units_run": self.units})

    def peek_next_unit_ready(self):
        return True

    def peek_next_unit(self):
        return None

    def run(self, gate, on_unit=None):
        from harvest.train.gate import GateAction

        while True:
            decision = gate.acquire()
            if decision.action is GateAction.STOP:
                self.checkpointed = True
                return "stopped"
            torch.randn(256, 256).mul(2).add(1).sum()  # a parallel op: the thread's count is settled
            self.threads_seen.append(torch.get_num_threads())
            self.nice_seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            self.units += 1
            if on_unit is not None:
                on_unit(None)


@pytest.fixture
def serving_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(saved)


def _started_host(trainer, **kwargs):
    unit_seen = threading.Event()
    host = TrainerHost(["job.yaml"], build=lambda path: trainer, on_unit=lambda record: unit_seen.set(), **kwargs)
    host.start()
    host.apply(True)
    assert unit_seen.wait(30), "the trainer ran no unit"
    return host


def test_trainer_thread_runs_on_its_cpu_threads_and_serving_threads_keep_theirs(serving_threads):
    trainer = FakeTrainer()
    serving_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    host = _started_host(trainer, cpu_threads=1, nice=3)
    try:
        assert set(trainer.threads_seen) == {1}
        assert torch.get_num_threads() == serving_threads  # the scheduler thread
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == serving_nice
        if sys.platform.startswith("linux"):  # threads have their own nice value there only
            assert set(trainer.nice_seen) == {min(19, serving_nice + 3)}
        seen = []
        later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        later.start()
        later.join()
        assert seen == [serving_threads]  # threads started later take the serving default
    finally:
        host.shutdown(10)
    assert trainer.checkpointed and host.status().state == "stopped"


def test_operator_pause_stops_units_and_stop_checkpoints(serving_threads):
    trainer = FakeTrainer()
    host = _started_host(trainer)
    host.operator_pause()
    assert host.scheduler_state() is TrainerState.PAUSED
    assert host.gate.wait_until_parked(10)
    units = trainer.units
    host.apply(True)  # the scheduler cannot override an operator pause
    assert host.gate.wait_until_parked(1) and trainer.units == units
    host.operator_stop()
    assert host.join(10)
    assert trainer.checkpointed and host.status().state == "stopped"


def test_a_failing_build_is_a_fault_not_a_crash():
    faults = []

    def build(path):
        raise MemoryError("no room for the trainer")

    host = TrainerHost(["job.yaml"], build=build, on_fault=faults.append)
    host.start()
    assert host.join(30)
    status = host.status()
    assert status.state == "failed" and "MemoryError: no room for the trainer" in status.error
    assert len(faults) == 1 and isinstance(faults[0], MemoryError)
    assert host.scheduler_state() is TrainerState.FAILED  # the scheduler pauses it: trainer_stopped


@pytest.mark.parametrize(
    ("trainer_threads", "decode_threads", "cores", "expected"),
    [
        (1, 2, 2, 1),  # this CI machine: one core each
        (1, 16, 16, 15),
        (2, 4, 16, 4),  # decode never gets more threads than it had
        (4, 8, 4, 1),  # a trainer on every core still leaves decode one thread
        (1, 1, 1, 1),
    ],
)
def test_decode_keeps_the_cores_the_trainer_leaves(trainer_threads, decode_threads, cores, expected):
    from harvest.train.trainer_cpu import decode_threads_beside_trainer

    assert decode_threads_beside_trainer(trainer_threads, decode_threads, cores) == expected


def test_decode_threads_refuse_a_count_below_one():
    from harvest.train.trainer_cpu import decode_threads_beside_trainer

    with pytest.raises(ValueError, match="trainer_threads=0"):
        decode_threads_beside_trainer(0, 2, 2)


def test_leave_cores_to_trainer_sets_this_threads_count_and_the_default_for_later_threads(serving_threads, monkeypatch):
    from harvest.train import trainer_cpu

    monkeypatch.setattr(trainer_cpu, "usable_cores", lambda: 2)
    assert trainer_cpu.leave_cores_to_trainer(1) == (serving_threads, 1)
    assert torch.get_num_threads() == 1
    seen = []
    later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    later.start()
    later.join()
    assert seen == [1]
    assert trainer_cpu.leave_cores_to_trainer(1) == (1, 1)  # already within its share: unchanged


def test_oversubscription_is_named_with_the_setting_that_fixes_it():
    from harvest.train.trainer_cpu import oversubscription

    assert oversubscription(1, 1, 2) is None and oversubscription(2, 14, 16) is None
    assert oversubscription(2, 1, 2) == (
        "the trainer's 2 and decode's 1 torch thread(s) exceed this CPU's 2 core(s): co-located decode steps will stall; "
        "set trainer.cpu_threads to at most 1"
    )
    assert oversubscription(1, 1, 1).endswith("will stall")  # one core: no setting fixes it
