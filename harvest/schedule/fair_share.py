"""Fair share of the trainer's time between the jobs of one server (pure policy).

FlexLLM's virtual counters in trainer seconds: each job's virtual time is
``service_s / weight`` and the next slice goes to the runnable job with the least; a slice
lasts at least ``quantum_s``; a joining job starts at the least running virtual time (no
back-pay); a job that waited ``starvation_s`` runs next whatever the counters say.
``deficit_s`` is a job's weighted share of the service minus its own (> 0: behind).
Standard library only; time comes in as arguments (tests drive it).

Rules: docs/design.md §4, 'The jobs' fair share (harvest/schedule/fair_share.py)'.
"""

from __future__ import annotations

import dataclasses
import math

from harvest.settings import Integer, Number, setting, validate

DEFAULT_QUANTUM_S = 0.5
DEFAULT_STARVATION_S = 30.0


@dataclasses.dataclass(frozen=True)
class JobQueueConfig:
    """harvest.yaml's ``queue`` section."""

    # Each running job holds its LoRA state, and a host copy of its base model unless it
    # trains on the served weights: the bound is memory.
    max_running: int = setting(4, "jobs built and sharing the trainer at once; the others wait in order",
                               Integer(minimum=1, maximum=64))
    quantum_s: float = setting(DEFAULT_QUANTUM_S, "least trainer time a job runs before another may take the trainer, "
                               "in seconds (a switch reloads the frozen-weight window)",
                               Number(minimum=0.0, exclusive_minimum=True))
    starvation_s: float = setting(DEFAULT_STARVATION_S, "a runnable job that waited this long since its last slice "
                                  "runs next, whatever its weight, in seconds",
                                  Number(minimum=0.0, exclusive_minimum=True))

    def __post_init__(self) -> None:
        validate(self)


@dataclasses.dataclass
class ShareAccount:
    name: str
    weight: float
    order: int  # submission order: breaks ties
    virtual_s: float = 0.0  # service / weight, from the moment it joined
    service_s: float = 0.0  # trainer seconds charged to it
    runnable: bool = False
    waiting_since: float | None = None  # since when it is runnable and not running
    slices: int = 0


class FairShare:
    """The accounts of the jobs sharing the trainer, and the choice of the next slice."""

    def __init__(self, quantum_s: float = DEFAULT_QUANTUM_S, starvation_s: float = DEFAULT_STARVATION_S):
        if not quantum_s > 0 or not math.isfinite(quantum_s):
            raise ValueError(f"quantum_s must be a positive number of seconds, got {quantum_s!r}")
        if not starvation_s > 0:
            raise ValueError(f"starvation_s must be a positive number of seconds, got {starvation_s!r}")
        self.quantum_s = quantum_s
        self.starvation_s = starvation_s
        self.accounts: dict[str, ShareAccount] = {}
        self.running: str | None = None  # the job holding the current slice
        self.slice_s = 0.0  # trainer time of the current slice so far
        self._order = 0

    # -- membership ---------------------------------------------------------------------
    def add(self, name: str, weight: float) -> ShareAccount:
        """A job that will share the trainer (not runnable until :meth:`set_runnable`)."""
        _check_weight(name, weight)
        if name in self.accounts:
            raise ValueError(f"a job named {name!r} already shares the trainer")
        self._order += 1
        account = ShareAccount(name, float(weight), self._order)
        self.accounts[name] = account
        return account

    def remove(self, name: str) -> None:
        """The job ended (finished, stopped, cancelled, failed): it no longer shares."""
        self.accounts.pop(name, None)
        if self.running == name:
            self.running, self.slice_s = None, 0.0

    def set_runnable(self, name: str, runnable: bool, now: float) -> None:
        """The job can (or can no longer) run a unit: built and not ended."""
        account = self.accounts[name]
        if runnable == account.runnable:
            return
        if runnable:
            # Joins at the least virtual time of those already runnable: its share from now on.
            floor = min((a.virtual_s for a in self.accounts.values() if a.runnable), default=None)
            if floor is not None and account.virtual_s < floor:
                account.virtual_s = floor
            account.waiting_since = now
        else:
            account.waiting_since = None
            if self.running == name:
                self.running, self.slice_s = None, 0.0
        account.runnable = runnable

    def set_weight(self, name: str, weight: float) -> None:
        _check_weight(name, weight)
        # Its virtual time stays where it is (its place in the queue now); only service from
        # here on counts at the new weight. Rescaling v would pay the change backwards: a
        # job raised from 1 to 3 would run alone until its past service caught up.
        self.accounts[name].weight = float(weight)

    # -- service ------------------------------------------------------------------------
    def charge(self, name: str, seconds: float) -> None:
        """``seconds`` of trainer time went to ``name`` (one unit)."""
        if seconds < 0 or not math.isfinite(seconds):
            raise ValueError(f"a unit's trainer time must be a finite non-negative number, got {seconds!r}")
        account = self.accounts.get(name)
        if account is None:
            return  # removed while its last unit ran
        account.service_s += seconds
        account.virtual_s += seconds / account.weight
        if self.running == name:
            self.slice_s += seconds

    # -- choice -------------------------------------------------------------------------
    def choose(self, now: float) -> str | None:
        """The job that should hold the trainer now: a starving one first (the longest
        waiting), else the least virtual time. None when nothing is runnable."""
        runnable = [a for a in self.accounts.values() if a.runnable]
        if not runnable:
            return None
        starving = [a for a in runnable if a.name != self.running and a.waiting_since is not None
                    and now - a.waiting_since >= self.starvation_s]
        if starving:
            return min(starving, key=lambda a: (a.waiting_since, a.order)).name
        return min(runnable, key=lambda a: (a.virtual_s, a.order)).name

    def next_slice(self, now: float) -> str | None:
        """At a unit boundary: the job to run the next unit. The running job keeps the
        trainer until its slice reached ``quantum_s`` (or it is no longer runnable);
        then :meth:`choose` decides. Switching starts a new slice."""
        current = self.accounts.get(self.running) if self.running is not None else None
        if current is not None and current.runnable and self.slice_s < self.quantum_s:
            return current.name
        chosen = self.choose(now)
        if chosen != self.running:
            self.switch_to(chosen, now)
        elif chosen is not None:
            self.slice_s = 0.0  # the same job again: a new slice
        return chosen

    def switch_to(self, name: str | None, now: float) -> None:
        previous = self.accounts.get(self.running) if self.running is not None else None
        if previous is not None and previous.runnable:
            previous.waiting_since = now
        self.running, self.slice_s = name, 0.0
        if name is not None:
            account = self.accounts[name]
            account.waiting_since = None
            account.slices += 1

    # -- reporting ----------------------------------------------------------------------
    def deficit_s(self, name: str) -> float:
        """Trainer seconds ``name`` is behind its weighted share of the service the jobs
        sharing now received since they joined (negative: ahead)."""
        account = self.accounts.get(name)
        active = [a for a in self.accounts.values() if a.runnable]
        if account is None or not account.runnable or not active:
            return 0.0
        total_weight = sum(a.weight for a in active)
        mean_virtual = sum(a.weight * a.virtual_s for a in active) / total_weight
        return account.weight * (mean_virtual - account.virtual_s)

    def shares(self) -> dict[str, float]:
        """Each account's share of all the trainer time charged (0..1)."""
        total = sum(a.service_s for a in self.accounts.values())
        return {name: (a.service_s / total if total > 0 else 0.0) for name, a in self.accounts.items()}


def _check_weight(name: str, weight: float) -> None:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"job {name!r}: weight must be a positive number, got {weight!r}")
