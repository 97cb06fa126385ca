"""The trainer host's job queue as policy: which job is built next, which one holds the
trainer, and what a job's end, cancellation or refusal does to the others.

Plain data and no threads: :class:`JobQueue` changes :class:`JobRun` records and the
fair-share accounts (:mod:`harvest.schedule.fair_share`), and says when the trainer
changes hands (:class:`Handover`); harvest.colocate.trainer_host carries that out on the
jobs' threads and gates. Up to ``max_running`` jobs are built (building or running) at
once; the others wait in submission order. Only a running job shares the trainer; the
one holding it is ``active``. Callers serialise calls (the host holds its lock).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path

from harvest.metrics.registry import ENDED_JOB_STATES
from harvest.schedule import TrainerState
from harvest.schedule.fair_share import FairShare

BUILT_STATES = ("building", "running")  # counted against max_running
LIVE_STATES = ("queued", *BUILT_STATES)


class JobRefused(ValueError):
    """A submission, cancellation or weight change the queue refuses (the message says why)."""


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """A job as the queue knows it before building it (harvest.train.job.JobIdentity fits)."""

    path: Path
    name: str
    weight: float = 1.0
    serve_as: str | None = None
    output_dir: Path | None = None


class JobRun:
    """One job in the host, from its submission to its end. The queue sets its state and
    accounting; the host sets ``gate``, ``thread`` and ``error``; the runtime ``adapter``."""

    def __init__(self, instance: int, spec: JobSpec):
        self.instance = instance
        self.spec = spec
        self.name = spec.name
        self.weight = spec.weight
        self.state = "queued"  # queued | building | running | finished | stopped | cancelled | failed
        self.gate = None  # harvest.colocate.job_gates.JobGate, from its start
        self.thread = None  # its threading.Thread, from its start
        self.trainer = None
        self.error: str | None = None
        self.submitted_at = time.time()
        self.started_at: float | None = None
        self.running_since: float | None = None  # monotonic, when its trainer was built
        self.ended_at: float | None = None
        self.trainer_s = 0.0  # trainer time charged to it
        self.cancelled = False
        self.baseline = (0, 0, 0)  # (tokens, samples, steps) when built: a resume starts counting from there
        self.adapter: dict | None = None  # its served adapter: {"name", "state", "error"} (the runtime sets it)
        # Its units against the profile's co-run workload, checked once after its first
        # step (TrainerHost's corun_check): the problem in words, or None.
        self.corun_checked = False
        self.corun_mismatch: str | None = None

    @property
    def ended(self) -> bool:
        return self.state in ENDED_JOB_STATES


@dataclasses.dataclass(frozen=True)
class Handover:
    """The trainer changes hands: ``previous`` (None: nobody held it, or it ended) parks;
    ``target`` (None: nobody) holds it from its next unit."""

    previous: JobRun | None
    target: JobRun | None


class JobQueue:
    """The jobs of one host and who holds the trainer. ``now`` arguments are
    ``time.monotonic()`` seconds (tests pass their own)."""

    def __init__(self, specs: list[JobSpec], *, max_running: int, fair: FairShare):
        self.max_running = max_running
        self.fair = fair
        self.runs: list[JobRun] = []
        self.active: JobRun | None = None  # the job holding the trainer
        self.last_active: JobRun | None = None  # the last job that held it
        self.stopped = False  # no job starts any more (the operator stopped the trainer)
        self._instances = itertools.count(1)
        for spec in specs:
            self.add(spec)

    # -- membership -------------------------------------------------------------------
    def add(self, spec: JobSpec) -> JobRun:
        """Queue ``spec``. Refused (JobRefused) when its name or output folder is a live job's."""
        for other in self.runs:
            if other.ended:
                continue
            clash = spec_clash(spec, other.spec)
            if clash == "name":
                raise JobRefused(f"a job named {spec.name!r} is already {other.state}; cancel it first or name this "
                                 "one differently (harvest: {name: ...})")
            if clash is not None:
                raise JobRefused(f"job {spec.name!r}: {clash} is the output_dir of job "
                                 f"{other.name!r} ({other.state}); two jobs would overwrite each other's checkpoints")
        run = JobRun(next(self._instances), spec)
        self.runs.append(run)
        return run

    def submit(self, spec: JobSpec) -> JobRun:
        """`add` at run time: refused after a stop as well."""
        if self.stopped:
            raise JobRefused("the trainer has been stopped: no more jobs run until the server restarts")
        return self.add(spec)

    def live(self, name: str) -> JobRun:
        """The live (queued, building or running) job ``name``; JobRefused when there is none."""
        for run in self.runs:
            if run.name == name and not run.ended:
                return run
        known = sorted({run.name for run in self.runs if not run.ended})
        raise JobRefused(f"no live job named {name!r}" + (f" (live: {', '.join(known)})" if known else " (none is live)"))

    @property
    def any_live(self) -> bool:
        return any(run.state in LIVE_STATES for run in self.runs)

    @property
    def any_built(self) -> bool:
        return any(run.state in BUILT_STATES for run in self.runs)

    # -- a job's life -----------------------------------------------------------------
    def next_to_start(self) -> JobRun | None:
        """The first queued job, now building, while fewer than ``max_running`` are built
        and the queue is not stopped; None otherwise."""
        if self.stopped or sum(run.state in BUILT_STATES for run in self.runs) >= self.max_running:
            return None
        run = next((run for run in self.runs if run.state == "queued"), None)
        if run is not None:
            run.state, run.started_at = "building", time.time()
        return run

    def built(self, run: JobRun, trainer, baseline: tuple[int, int, int], now: float) -> Handover | None:
        """``run``'s trainer is built (``baseline``: its tokens, samples and steps then): it
        shares the trainer, and holds it when nobody does."""
        run.trainer, run.baseline, run.running_since, run.state = trainer, baseline, now, "running"
        self.fair.add(run.name, run.weight)
        self.fair.set_runnable(run.name, True, now)
        if self.active is None:
            return self._hand_to(self.fair.next_slice(now), now)
        return None

    def end(self, run: JobRun, outcome: str, now: float) -> Handover | None:
        """``run`` ended (finished, stopped, cancelled, failed); if it held the trainer, the
        fair-share rule picks who holds it next (the Handover's ``previous`` is None)."""
        was_sharing = run.state == "running"  # a name is live at most once: its account is this run's
        run.state, run.ended_at = outcome, time.time()
        if was_sharing:
            self.fair.remove(run.name)
        if self.active is not run:
            return None
        self.active = None
        return self._hand_to(self.fair.next_slice(now), now) or Handover(None, None)

    def unit_done(self, run: JobRun, seconds: float, now: float) -> Handover | None:
        """``run`` spent ``seconds`` of trainer time on a unit: charge it; at the end of its
        slice the trainer goes to the job the fair-share rule picks."""
        run.trainer_s += seconds
        self.fair.charge(run.name, seconds)
        if len(self.fair.accounts) < 2 or self.active is not run:
            return None
        chosen = self.fair.next_slice(now)
        if chosen == run.name:
            return None
        return self._hand_to(chosen, now)

    def _hand_to(self, name: str | None, now: float) -> Handover | None:
        previous = self.active
        target = next((r for r in self.runs if r.name == name and r.state == "running"), None) if name else None
        if previous is target:
            return None
        if name is not None and self.fair.running != name:
            self.fair.switch_to(name, now)
        self.active = target
        if target is not None:
            self.last_active = target
        return Handover(previous, target)

    # -- operator ---------------------------------------------------------------------
    def cancel(self, name: str, now: float) -> JobRun:
        """Mark the live job ``name`` cancelled. A queued one ends now (``ended``); a
        building or running one is left to the host to stop at its next unit boundary."""
        run = self.live(name)
        run.cancelled = True
        if run.state == "queued":
            self.end(run, "cancelled", now)
        return run

    def set_weight(self, name: str, weight: float) -> tuple[JobRun, float]:
        """Set the live job ``name``'s weight; returns it and its previous weight.
        ValueError (JobRefused when not yet sharing) for a weight that is not positive."""
        run = self.live(name)
        if name in self.fair.accounts:
            self.fair.set_weight(name, weight)  # raises ValueError for a bad weight
        elif not (isinstance(weight, (int, float)) and not isinstance(weight, bool) and 0 < weight < float("inf")):
            raise JobRefused(f"job {name!r}: weight must be a positive number, got {weight!r}")
        previous, run.weight = run.weight, float(weight)
        return run, previous

    def stop(self) -> None:
        """No job starts any more; queued ones end as stopped (the host stops the others)."""
        self.stopped = True
        for run in self.runs:
            if run.state == "queued":
                run.state, run.ended_at = "stopped", time.time()

    # -- reading ------------------------------------------------------------------------
    def idle_state(self, operator_paused: bool) -> TrainerState:
        """The trainer's state while no job holds it: one is building, or none is live."""
        runs = self.runs
        if not runs:
            return TrainerState.ABSENT
        if any(run.state in LIVE_STATES for run in runs):
            return TrainerState.PAUSED if operator_paused else TrainerState.BUILDING
        if self.stopped:
            return TrainerState.STOPPED
        last = max(runs, key=lambda run: run.ended_at or 0.0)
        return {"failed": TrainerState.FAILED, "finished": TrainerState.FINISHED}.get(last.state, TrainerState.STOPPED)

    def shares(self) -> dict[int, float]:
        """Each running job's share (by instance) of the trainer time charged to the jobs running now."""
        running = [run for run in self.runs if run.state == "running"]
        total = sum(run.trainer_s for run in running)
        return {run.instance: (run.trainer_s / total if total > 0 else 0.0) for run in running}


def spec_clash(spec: JobSpec, other: JobSpec) -> str | None:
    """What two jobs that live at once must not share, as a message names it: ``"name"``
    (status, ctl and metrics address a job by it) or ``"output_dir <path>"`` (each would
    overwrite the other's checkpoints); None when they share neither."""
    if spec.name == other.name:
        return "name"
    if spec.output_dir is not None and other.output_dir is not None \
            and Path(spec.output_dir).resolve() == Path(other.output_dir).resolve():
        return f"output_dir {spec.output_dir}"
    return None


def spec_of_path(path) -> JobSpec:
    """A job given as a bare path (tests, harnesses): named after its file."""
    path = Path(path)
    return JobSpec(path=path, name=path.name.removesuffix(".yaml").removesuffix(".yml") or str(path))
