"""The operator's run-time commands on a running co-location: the job queue (submit,
cancel), serving a job's adapter (publish), and the settings that may change while
serving (the QoS target, the lend fraction, job weights).

They arrive from the control endpoint over the control link and run on the engine thread
between decode steps, so each takes milliseconds: a submission (already checked in a child
process by the endpoint) reads only the job file's YAML here, and adapters load on a
thread of their own (:class:`AdapterServing`). Each returns ``(HTTP status, reply)``: 400
for an invalid request (nothing changes), 404 for an unknown job, 409 for one the server's
state refuses. Every change is logged and visible in ``/harvest/status`` and the metrics.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from pathlib import Path
from typing import Callable

from harvest.logs import get_logger

logger = get_logger(__name__)

ACTIONS = ("pause", "resume", "stop", "submit", "cancel", "publish", "set")
SETTINGS = ("target_tpot_ms", "max_lend_fraction", "weights")


def execute(colocation, action: str, args: dict) -> tuple[int, dict]:
    if action in ("pause", "resume", "stop"):
        return colocation.operator(action)
    handler = {"submit": submit, "cancel": cancel, "publish": publish, "set": change_settings}.get(action)
    if handler is None:
        return 404, {"error": f"no such action {action!r}"}
    if not isinstance(args, dict):
        return 400, {"error": f"{action}: the request body must be a JSON object"}
    return handler(colocation, args)


def _host_or_refusal(colocation):
    host = colocation.trainer_host
    if host is None:
        return None, (409, {"error": "this server runs no jobs: harvest.yaml has no profile (jobs need one; run "
                                     "`harvest profile`)"})
    return host, None


def _text(args: dict, key: str, *, required: bool = True) -> str | None:
    value = args.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key!r} must be a non-empty string, got {value!r}")
    return value


# -- the queue ---------------------------------------------------------------------------
def submit(colocation, args: dict) -> tuple[int, dict]:
    from harvest.colocate.job_queue import JobRefused, JobSpec
    from harvest.train.errors import JobError
    from harvest.train.job import job_identity

    host, refusal = _host_or_refusal(colocation)
    if refusal:
        return refusal
    if colocation.ranks is not None:
        return 409, {"error": "jobs cannot be submitted at run time to a tensor-parallel server yet (every rank "
                              "would have to agree on the queue): list them in harvest.yaml jobs"}
    try:
        path = Path(_text(args, "path"))
        if not path.is_absolute():
            raise ValueError(f"'path' must be absolute (the server's working directory is not yours): {path}")
        identity = job_identity(path)
    except (ValueError, JobError) as exc:
        return 400, {"error": str(exc)}
    if host.stopped or colocation._operator_stopped:
        return 409, {"error": "the trainer has been stopped: no more jobs run until the server restarts"}
    colocation._leave_cores_to_trainer()
    try:
        run = host.submit(JobSpec(identity.path, identity.name, identity.weight, identity.serve_as,
                                  identity.output_dir))
    except JobRefused as exc:
        return 409, {"error": str(exc)}
    colocation.lend_again_for_live_jobs()  # an earlier job's fault may have turned lending off
    return 202, {"job": run.name, "instance": run.instance, "state": run.state, "weight": run.weight,
                 "path": str(identity.path)}


def cancel(colocation, args: dict) -> tuple[int, dict]:
    from harvest.colocate.job_queue import JobRefused

    host, refusal = _host_or_refusal(colocation)
    if refusal:
        return refusal
    try:
        name = _text(args, "name")
    except ValueError as exc:
        return 400, {"error": str(exc)}
    if colocation.ranks is not None:
        return 409, {"error": "a job of a tensor-parallel server cannot be cancelled alone yet; stop the trainer"}
    if not any(run.name == name for run in host.runs):
        return 404, {"error": f"no job named {name!r}"}
    try:
        run = host.cancel(name)
    except JobRefused as exc:
        return 409, {"error": str(exc)}
    return 200, {"job": run.name, "state": "cancelled" if run.state == "cancelled" else "cancelling (checkpoint first)"}


# -- run-time settings -------------------------------------------------------------------
def change_settings(colocation, args: dict) -> tuple[int, dict]:
    """All of ``args`` is validated before anything changes: a request with one bad value
    changes nothing."""
    from harvest.settings import SettingError

    unknown = sorted(set(args) - set(SETTINGS))
    if unknown:
        return 400, {"error": f"unknown setting {unknown[0]!r} (run-time settings: {', '.join(SETTINGS)})"}
    if not args:
        return 400, {"error": f"nothing to set (run-time settings: {', '.join(SETTINGS)})"}
    host = colocation.trainer_host
    changes: list[Callable[[], str]] = []
    try:
        if "target_tpot_ms" in args:
            qos = dataclasses.replace(colocation.step_controller.qos.config, target_tpot_ms=args["target_tpot_ms"])
            changes.append(lambda: _set_target(colocation, qos))
        if "max_lend_fraction" in args:
            if colocation.ranks is not None:
                return 409, {"error": "max_lend_fraction cannot change at run time on a tensor-parallel server yet "
                                      "(every rank must lend the same chunks)"}
            memory = dataclasses.replace(colocation.config.memory, max_lend_fraction=args["max_lend_fraction"])
            changes.append(lambda: _set_lend_fraction(colocation, memory.max_lend_fraction))
        weights = args.get("weights")
        if weights is not None:
            if not isinstance(weights, dict) or not weights:
                raise ValueError(f"'weights' must be an object of job name -> weight, got {weights!r}")
            live = {run.name for run in host.runs if not run.ended} if host is not None else set()
            for name, weight in weights.items():
                if name not in live:
                    return 404, {"error": f"no live job named {name!r}" + (f" (live: {', '.join(sorted(live))})"
                                                                           if live else "")}
                if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
                    raise ValueError(f"weights.{name}: must be a positive number, got {weight!r}")
                changes.append(lambda name=name, weight=weight: _set_weight(host, name, weight))
    except (SettingError, ValueError) as exc:
        return 400, {"error": str(exc)}
    done = [change() for change in changes]
    return 200, {"changed": done, "settings": current_settings(colocation)}


def _set_target(colocation, qos) -> str:
    step_controller = colocation.step_controller
    before = step_controller.qos.config.target_tpot_ms
    step_controller.qos.config = qos
    step_controller.target_s = qos.target_tpot_ms / 1e3
    _metrics_settings(colocation)
    logger.info("operator: qos.target_tpot_ms %.3g -> %.3g", before, qos.target_tpot_ms)
    return f"target_tpot_ms {before:g} -> {qos.target_tpot_ms:g}"


def _set_lend_fraction(colocation, fraction: float) -> str:
    lending = colocation.lending
    policy = getattr(lending, "policy", None)
    if policy is None:
        raise ValueError("this server lends no KV memory: max_lend_fraction has nothing to change")
    before = policy.max_lend_fraction
    lending.policy = dataclasses.replace(policy, max_lend_fraction=fraction)
    lending.maybe_lend(force=True)  # lowered: the excess comes back now; raised: lends at once
    _metrics_settings(colocation)
    logger.info("operator: memory.max_lend_fraction %.3g -> %.3g", before, fraction)
    return f"max_lend_fraction {before:g} -> {fraction:g}"


def _set_weight(host, name: str, weight: float) -> str:
    before = next(run.weight for run in host.runs if run.name == name and not run.ended)
    host.set_weight(name, weight)
    return f"weight of {name} {before:g} -> {weight:g}"


def current_settings(colocation) -> dict:
    """The run-time values (``/harvest/status`` ``settings``)."""
    policy = getattr(colocation.lending, "policy", None)
    return {"target_tpot_ms": colocation.step_controller.qos.config.target_tpot_ms,
            "max_lend_fraction": policy.max_lend_fraction if policy is not None else None}


def _metrics_settings(colocation) -> None:
    metrics = colocation.metrics
    if metrics is not None:
        settings = current_settings(colocation)
        metrics.set_settings(target_tpot_s=settings["target_tpot_ms"] / 1e3,
                             max_lend_fraction=settings["max_lend_fraction"])


# -- serving adapters --------------------------------------------------------------------
def publish(colocation, args: dict) -> tuple[int, dict]:
    from harvest.train.job import JOB_NAME_EXPECTED, JOB_NAME_PATTERN

    host, refusal = _host_or_refusal(colocation)
    if refusal:
        return refusal
    try:
        name = _text(args, "name")
        served_name = _text(args, "as", required=False)
        if served_name is not None and not re.fullmatch(JOB_NAME_PATTERN, served_name):
            raise ValueError(f"'as' must be an adapter name of {JOB_NAME_EXPECTED}, got {served_name!r}")
    except ValueError as exc:
        return 400, {"error": str(exc)}
    runs = [run for run in host.runs if run.name == name]
    if not runs:
        return 404, {"error": f"no job named {name!r}"}
    run = runs[-1]  # the latest run of that name
    served_name = served_name or run.spec.serve_as or run.name
    if colocation.adapters is None:
        return 409, {"error": "this engine cannot serve adapters"}
    problem = colocation.adapters.problem
    if problem is not None:
        return 409, {"error": f"this server cannot serve adapters: {problem}"}
    adapter_dir = adapter_dir_of(run)
    if adapter_dir is None:
        return 409, {"error": f"job {name!r} ({run.state}) has no adapter yet: it writes one at its first "
                              "checkpoint (save_steps) and when it finishes"}
    colocation.adapters.publish(run, served_name, adapter_dir)
    return 202, {"job": run.name, "adapter": served_name, "path": str(adapter_dir), "state": "loading"}


def adapter_dir_of(run) -> Path | None:
    """The adapter a job can be served with now: its final adapter once finished, else its
    latest checkpoint's (a snapshot of a job in progress)."""
    output_dir = run.spec.output_dir
    if output_dir is None and run.trainer is not None:
        output_dir = run.trainer.output_dir
    if output_dir is None:
        return None
    output_dir = Path(output_dir)
    if run.state == "finished" and (output_dir / "adapter_config.json").is_file():
        return output_dir
    checkpoints = []
    for child in output_dir.glob("checkpoint-*") if output_dir.is_dir() else ():
        suffix = child.name.removeprefix("checkpoint-")
        if suffix.isdigit() and (child / "adapter_config.json").is_file():
            checkpoints.append((int(suffix), child))
    return max(checkpoints)[1] if checkpoints else None


class AdapterServing:
    """Loads a job's adapter into the serving engine under a name, off the engine thread
    (the engine itself loads it between steps: SGLang's /load_lora_adapter). ``load(name,
    path)`` raises with the engine's reason; ``problem``: why this engine cannot serve
    adapters at all (None: it can)."""

    def __init__(self, load: Callable[[str, Path], object], problem: str | None = None,
                 unload: Callable[[str], object] | None = None):
        self._load = load
        self._unload = unload
        self.problem = problem
        self.threads: list[threading.Thread] = []
        self.served: set[str] = set()  # names loaded into the engine by this server
        self._lock = threading.Lock()  # one load at a time: a name is unloaded and loaded again in order

    def publish(self, run, served_name: str, adapter_dir: Path | None = None) -> None:
        """Any thread: start loading; ``run.adapter`` says how it goes (loading, served, failed)."""
        if self.problem is not None:
            run.adapter = {"name": served_name, "state": "failed", "path": None,
                           "error": f"this server cannot serve adapters: {self.problem}"}
            logger.warning("job %s: adapter not served as %s: %s", run.name, served_name, self.problem)
            return
        adapter_dir = adapter_dir or adapter_dir_of(run)
        if adapter_dir is None:
            run.adapter = {"name": served_name, "state": "failed", "path": None, "error": "no adapter written"}
            return
        run.adapter = {"name": served_name, "state": "loading", "path": str(adapter_dir), "error": None}
        thread = threading.Thread(target=self._load_now, args=(run, served_name, Path(adapter_dir)),
                                  name=f"harvest-adapter-{served_name}", daemon=True)
        self.threads.append(thread)
        thread.start()

    def _load_now(self, run, served_name: str, adapter_dir: Path) -> None:
        try:
            with self._lock:
                if served_name in self.served and self._unload is not None:
                    self._unload(served_name)  # a newer adapter under the same name replaces the old
                    self.served.discard(served_name)
                self._load(served_name, adapter_dir)
                self.served.add(served_name)
        except Exception as exc:  # noqa: BLE001 - the status says why; serving goes on
            run.adapter = {"name": served_name, "state": "failed", "path": str(adapter_dir), "error": str(exc)}
            logger.error("job %s: could not serve its adapter as %s: %s", run.name, served_name, exc)
            return
        run.adapter = {"name": served_name, "state": "served", "path": str(adapter_dir), "error": None}
        logger.info("job %s: adapter %s served as %s", run.name, adapter_dir, served_name)
