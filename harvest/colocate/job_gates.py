"""The gates the trainer host puts in front of its jobs' trainers, and injected faults.

A job's gate (:class:`JobGate`) is a :class:`harvest.train.gate.Gate` that also tells
the host each unit's trainer time, at the unit boundary where the host may end the
job's slice. ``HARVEST_FAULT_AFTER_UNITS`` makes a gate raise after that many units, to
test that a trainer fault ends only its job.
"""

from __future__ import annotations

import time
from typing import Callable

from harvest.train.gate import Gate


class InjectedTrainerFault(RuntimeError):
    """Raised on purpose (HARVEST_FAULT_AFTER_UNITS) to test fault isolation."""


_FAULT_MESSAGE = "injected trainer fault after a unit (HARVEST_FAULT_AFTER_UNITS)"


class FaultInjectingGate:
    """Delegates to a gate; raises after ``after_units`` units (the tensor-parallel fault
    tests drive a trainer through it directly; a server's jobs inject through JobGate)."""

    def __init__(self, gate, after_units: int):
        self._gate = gate
        self._remaining = after_units

    def acquire(self, while_parked=None):
        return self._gate.acquire(while_parked)

    def wake(self) -> None:
        self._gate.wake()

    def unit_done(self, record) -> None:
        self._gate.unit_done(record)
        self._remaining -= 1
        if self._remaining <= 0:
            raise InjectedTrainerFault(_FAULT_MESSAGE)


class JobGate(Gate):
    """A job's gate: ``on_unit_done(seconds)`` gets each unit's trainer time (from the
    gate letting it through to its end), on the job's thread."""

    def __init__(self, on_unit_done: Callable[[float], None], fault_after_units: int | None = None):
        super().__init__()
        self._on_unit_done = on_unit_done
        self._acquired_at: float | None = None
        self._fault_after = fault_after_units

    def acquire(self, while_parked=None):
        decision = super().acquire(while_parked)
        self._acquired_at = time.monotonic()
        return decision

    def unit_done(self, record) -> None:
        if self._acquired_at is not None:
            self._on_unit_done(time.monotonic() - self._acquired_at)
            self._acquired_at = None
        if self._fault_after is not None:
            self._fault_after -= 1
            if self._fault_after <= 0:
                raise InjectedTrainerFault(_FAULT_MESSAGE)
