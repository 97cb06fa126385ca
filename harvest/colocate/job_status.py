"""What the trainer host reports: its status, and one line per job (``/harvest/status``,
the metrics' ``set_jobs``, ``harvest top``)."""

from __future__ import annotations

import dataclasses
import time

from harvest.schedule import TrainerState


@dataclasses.dataclass(frozen=True)
class HostStatus:
    state: TrainerState
    job: str | None  # the job holding the trainer (or the last one that did)
    jobs_done: int
    jobs_total: int
    operator_paused: bool
    error: str | None  # the latest job fault
    stats: dict | None  # that job's harvest.train TrainerStats as a dict
    jobs: list = dataclasses.field(default_factory=list)  # one dict per job: job_line()


def job_line(run, *, active: bool, host_paused: bool, starved: bool, share: float, deficit_s: float) -> dict:
    """The line of ``run`` (harvest.colocate.job_queue.JobRun): its state as the operator
    sees it (paused, starved), progress and ETA, counters since it was built, its share of
    the trainer, its adapter and error."""
    trainer = run.trainer
    stats = trainer.stats() if trainer is not None else None
    state = run.state
    if state == "running":
        state = "paused" if host_paused else "starved" if active and starved else "running"
    total = stats.total_steps if stats is not None else None
    step = stats.global_step if stats is not None else 0
    progress = (step / total) if total else (1.0 if run.state == "finished" else 0.0)
    eta_s = None
    fleet = stats.fleet if stats is not None else None
    steps_trained = max(0, step - run.baseline[2])
    if fleet is not None and fleet["sync"] == "periodic":
        # The progress is the fleet's: this server trained only its own steps of it, and
        # the ETA is the fleet's pace since this member joined.
        steps_trained, eta_s = fleet["steps_trained"], fleet["eta_s"] if not run.ended else None
    elif stats is not None and run.running_since is not None and not run.ended and step > run.baseline[2]:
        elapsed = time.monotonic() - run.running_since
        eta_s = elapsed / (step - run.baseline[2]) * (total - step)
    tokens, samples = (stats.tokens_seen, stats.samples_seen) if stats is not None else (0, 0)
    return {
        "instance": run.instance, "name": run.name, "path": str(run.spec.path), "state": state,
        "active": active, "weight": run.weight, "serve_as": run.spec.serve_as,
        "output_dir": str(run.spec.output_dir) if run.spec.output_dir is not None else None,
        "global_step": step, "total_steps": total, "progress": progress, "eta_s": eta_s,
        # the newest checkpoint on disk (what `harvest ctl publish` serves of a running job):
        # global_step counts a step before its due checkpoint is written
        "checkpoint_step": stats.checkpoint_step if stats is not None else None,
        "loss": stats.loss if stats is not None else None,
        "eval_loss": stats.eval_loss if stats is not None else None,
        "tokens_seen": tokens, "samples_seen": samples,
        "tokens_trained": max(0, tokens - run.baseline[0]), "samples_trained": max(0, samples - run.baseline[1]),
        "steps_trained": steps_trained,
        "trainer_s": round(run.trainer_s, 6), "share": share, "deficit_s": deficit_s,
        "submitted_at": run.submitted_at, "started_at": run.started_at, "ended_at": run.ended_at,
        "adapter": dict(run.adapter) if run.adapter is not None else None, "error": run.error,
        "corun_mismatch": run.corun_mismatch,
        "fleet": fleet,
    }


def host_status(active, last, runs: list, shares: dict[int, float], deficits: dict[str, float], error: str | None,
                *, state: TrainerState, operator_paused: bool) -> HostStatus:
    """The host's status from what it read of its queue under its lock (the job holding the
    trainer, the last one, every job, shares by instance, deficits by name, the latest
    fault); ``state``: what the trainer does now. Reads each job's trainer stats."""
    starved = state is TrainerState.STARVED
    jobs = [job_line(run, active=run is active, host_paused=operator_paused and not run.ended, starved=starved,
                     share=shares.get(run.instance, 0.0),
                     deficit_s=deficits.get(run.name, 0.0) if run.state == "running" else 0.0)
            for run in runs]
    shown = active or last
    trainer = shown.trainer if shown is not None else None
    return HostStatus(
        state=state, job=shown.name if shown is not None else None,
        jobs_done=sum(run.state == "finished" for run in runs), jobs_total=len(runs),
        operator_paused=operator_paused, error=error,
        stats=dataclasses.asdict(trainer.stats()) if trainer is not None else None, jobs=jobs,
    )
