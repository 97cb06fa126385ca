"""A stop signal to a scheduler (harvest.sglang.shutdown.SignalCheckpoint): the trainer is
asked to stop, and the signal goes on to SGLang's handler only once the trainer has
ended; with tensor parallelism, only once every rank's trainer has (a rank that left
first would break its peers' collectives, and with them rank 0's checkpoint write)."""

from __future__ import annotations

import signal

import pytest

from harvest.sglang.shutdown import SignalCheckpoint


class Host:
    def __init__(self):
        self.stopped, self.ended = False, False

    def operator_stop(self):
        self.stopped = True

    def join(self, timeout_s=None):
        return self.ended


@pytest.fixture
def sglang_handler():
    """Stands for the handler SGLang installed before harvest: records what reached it."""
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    yield received
    signal.signal(signal.SIGTERM, previous)


def _signalled(host, peers_ended=None, timeout_s=60.0):
    asked = []
    checkpoint = SignalCheckpoint(host, lambda: asked.append(True), timeout_s=timeout_s, peers_ended=peers_ended)
    assert checkpoint.install()
    signal.raise_signal(signal.SIGTERM)
    assert host.stopped and asked and checkpoint.pending
    return checkpoint


def test_the_signal_goes_on_once_the_trainer_ended(sglang_handler):
    host = Host()
    checkpoint = _signalled(host)
    checkpoint.poll()
    assert checkpoint.pending and sglang_handler == []  # the trainer still checkpoints
    host.ended = True
    checkpoint.poll()
    assert not checkpoint.pending and sglang_handler == [signal.SIGTERM]


def test_a_tensor_parallel_rank_waits_for_every_ranks_trainer(sglang_handler):
    host, peers = Host(), {"ended": False}
    checkpoint = _signalled(host, peers_ended=lambda: peers["ended"])
    host.ended = True  # this rank's part of the collective checkpoint is done; rank 0 may still write
    checkpoint.poll()
    assert checkpoint.pending and sglang_handler == []
    peers["ended"] = True
    checkpoint.poll()
    assert not checkpoint.pending and sglang_handler == [signal.SIGTERM]


def test_a_rank_whose_peers_never_end_passes_the_signal_on_at_its_deadline(sglang_handler, caplog):
    host = Host()
    host.ended = True
    checkpoint = _signalled(host, peers_ended=lambda: False, timeout_s=0.0)
    checkpoint.poll()
    assert not checkpoint.pending and sglang_handler == [signal.SIGTERM]
    assert "another rank's trainer did not stop" in caplog.text


class Child:
    def __init__(self, exitcode=None):
        self.exitcode = exitcode

    def is_alive(self):
        return self.exitcode is None


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


NAMES = ["scheduler_0", "scheduler_1", "detokenizer"]


def test_the_server_waits_for_the_schedulers_when_a_child_ended_of_a_stop_signal():
    """SGLang's main process kills the server when any child ends; on a group SIGTERM the
    detokenizer ends at once, while the schedulers still checkpoint their trainers."""
    from harvest.sglang.shutdown import SchedulersFirst

    clock = Clock()
    first = SchedulersFirst(grace_s=15.0, clock=clock)
    schedulers, detokenizer = [Child(), Child()], Child(-signal.SIGTERM)
    assert first.hold([*schedulers, detokenizer], NAMES)
    clock.now = 5.0
    schedulers[1].exitcode = -signal.SIGTERM  # rank 1 checkpointed and passed the signal on
    assert first.hold([*schedulers, detokenizer], NAMES)
    schedulers[0].exitcode = -signal.SIGTERM
    assert not first.hold([*schedulers, detokenizer], NAMES)  # every scheduler is done: SGLang cleans up


def test_the_wait_for_the_schedulers_ends_at_the_grace():
    from harvest.sglang.shutdown import SchedulersFirst

    clock = Clock()
    first = SchedulersFirst(grace_s=15.0, clock=clock)
    children = [Child(), Child(), Child(-signal.SIGINT)]
    assert first.hold(children, NAMES)
    clock.now = 15.0
    assert not first.hold(children, NAMES)


@pytest.mark.parametrize("exitcode", [1, -signal.SIGKILL, -signal.SIGABRT, -signal.SIGSEGV])
def test_a_crashed_child_takes_the_server_down_at_once(exitcode):
    from harvest.sglang.shutdown import SchedulersFirst

    first = SchedulersFirst(grace_s=15.0, clock=Clock())
    assert not first.hold([Child(), Child(), Child(exitcode)], NAMES)
    # also beside a child that a stop signal ended
    assert not first.hold([Child(), Child(-signal.SIGTERM), Child(exitcode)], NAMES)


def test_nothing_is_held_while_every_child_runs_or_ended_well():
    from harvest.sglang.shutdown import SchedulersFirst

    first = SchedulersFirst(grace_s=15.0, clock=Clock())
    assert not first.hold([Child(), Child(), Child()], NAMES)
    assert not first.hold([Child(), Child(), Child(0)], NAMES)
