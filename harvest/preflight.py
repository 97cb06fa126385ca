"""What a co-location's configuration must pass before SGLang loads a model.

:func:`check` loads harvest.yaml and runs :data:`CHECKS` in order (the metrics endpoint's
address, the profile's content and model, every job file as ``harvest train --check``
checks it); the first failure is one :class:`PreflightError` naming the harvest.yaml file,
the field and the file it names. ``harvest launch`` runs :func:`check` before it execs
SGLang. The plugin's launcher hook runs :data:`LAUNCHER_CHECKS` itself (milliseconds);
where a CUDA driver exists it starts the job files' check in a child interpreter
(:func:`start_job_check`, ``python -m harvest.preflight --jobs-only``) so the launcher
holds no CUDA context, and awaits that child while its schedulers load the model, before
SGLang serves; where none exists it runs every check itself. What needs the device or the
loaded model is left to the scheduler.

Rules: docs/sglang-integration.md, 'The pre-flight check (harvest/preflight.py)'.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

from harvest.config import ConfigError, HarvestConfig, load, where


class PreflightError(ValueError):
    """harvest cannot start with this configuration; the message names the file and the field."""


@dataclasses.dataclass(frozen=True)
class LaunchInputs:
    """What the checks look at: harvest.yaml, loaded, and the served checkpoint as the
    launcher was given it (None where it is not known)."""

    config: HarvestConfig
    model_path: str | None = None
    sglang_host: str | None = None  # SGLang's --host, the endpoint's default host
    tp_size: int | None = None  # SGLang's --tp-size (alias --tp)


def check_profile(inputs: LaunchInputs) -> None:
    config = inputs.config
    if config.profile is None:
        return
    from harvest.predict.schema import Profile, ProfileError

    try:
        profile = Profile.load(config.profile)
    except ProfileError as exc:  # names the profile file and the JSON path
        raise PreflightError(f"{where(config.source)}profile: {exc}") from None
    if config.allow_profile_mismatch:
        return
    if inputs.tp_size is not None:
        from harvest.predict.compat import tp_mismatch

        problem = tp_mismatch(profile, inputs.tp_size)
        if problem is not None:
            raise PreflightError(f"{where(config.source)}profile: {config.profile} was measured at another tensor-parallel "
                                 f"degree ({problem}); run `harvest profile --tp {inputs.tp_size}`, or set "
                                 "allow_profile_mismatch: true (predictions will be off)")
    if inputs.model_path is None:
        return
    model_dir = Path(inputs.model_path).expanduser()
    if not (model_dir / "config.json").is_file():
        # A hub name or a remote store: SGLang resolves it later, and the scheduler
        # compares the profile with what it resolved to.
        return
    from harvest.predict.compat import model_config_hash_of_path, model_mismatch

    try:
        problem = model_mismatch(profile, model_config_hash_of_path(model_dir))
    except ValueError as exc:  # the served config.json is unreadable: say so, naming it
        raise PreflightError(f"{where(config.source)}profile: cannot compare {config.profile} with the served "
                             f"model: {exc}") from None
    if problem is not None:
        raise PreflightError(f"{where(config.source)}profile: {config.profile} was measured for another model "
                             f"({problem}); run `harvest profile` with the served model, or set "
                             "allow_profile_mismatch: true (predictions will be off)")


def check_job_files(inputs: LaunchInputs) -> None:
    """Each job as `harvest train --check` checks it (harvest.train.plan.ready_job: what the
    build would refuse), with the server's caps and tensor-parallel degree, before the
    model loads. The process's random generators are left as they were."""
    from harvest.train.errors import CheckpointError, JobError
    from harvest.train.job import generators_kept, load_job
    from harvest.train.plan import check_job

    config = inputs.config
    for index, path in enumerate(config.jobs):
        try:
            with generators_kept():
                check_job(load_job(path, in_server=True), tp_size=inputs.tp_size or 1)
        except (JobError, CheckpointError) as exc:  # names the job file, then the key or the checkpoint
            raise PreflightError(f"{where(config.source)}jobs[{index}]: {exc}") from None


def check_metrics_endpoint(inputs: LaunchInputs) -> None:
    from harvest.sglang.control_endpoint import check_bindable, endpoint_settings

    config = inputs.config
    try:
        resolved = endpoint_settings(config.metrics, inputs.sglang_host, config.source)
    except ValueError as exc:  # a bad HARVEST_METRICS_PORT/_HOST: the message names it
        raise PreflightError(f"harvest's metrics endpoint: {exc}") from None
    if resolved is None:
        return
    settings, origin = resolved
    problem = check_bindable(settings.host, settings.port)
    if problem is not None:
        raise PreflightError(f"{where(config.source)}harvest's metrics endpoint ({origin}): {problem}; give this "
                             "instance another port with --harvest-metrics-port N (or metrics.port; 0 turns the "
                             "endpoint off)")


# The checks `check` runs on a loaded harvest.yaml, in order; each raises PreflightError.
# A check added here runs in `harvest launch` and in the plugin's launcher hook alike.
# The port first: it costs nothing, the job check imports LlamaFactory.
CHECKS: tuple[Callable[[LaunchInputs], None], ...] = (check_metrics_endpoint, check_profile, check_job_files)
# What SGLang's launcher runs itself, before it starts anything: files and a socket, no
# CUDA. Where a CUDA driver exists the job check (LlamaFactory's TrainingArguments set up
# the device) runs in a child while the schedulers start (`start_job_check`); never the
# port check there, since by then the scheduler may hold that port itself.
LAUNCHER_CHECKS: tuple[Callable[[LaunchInputs], None], ...] = (check_metrics_endpoint, check_profile)
JOB_CHECKS: tuple[Callable[[LaunchInputs], None], ...] = (check_job_files,)


def load_config(config_path: str | os.PathLike | None) -> HarvestConfig:
    """harvest.yaml (None: the built-in defaults), its own fields validated."""
    if config_path is None:
        return HarvestConfig()
    try:
        return load(config_path)
    except ConfigError as exc:  # names the file and the field
        raise PreflightError(str(exc)) from None


def check(config_path: str | os.PathLike | None, *, model_path: str | None = None,
          sglang_host: str | None = None, tp_size: int | None = None,
          checks: tuple[Callable[[LaunchInputs], None], ...] = CHECKS) -> HarvestConfig:
    """Everything checkable before the model loads (module docstring), or only ``checks``;
    returns the config. ``model_path``, ``sglang_host``, ``tp_size``: the served checkpoint,
    SGLang's --host and --tp-size, when the caller knows them."""
    config = load_config(config_path)
    inputs = LaunchInputs(config, model_path, sglang_host, tp_size)
    for run_check in checks:
        run_check(inputs)
    return config


# LlamaFactory's imports and a dataset's preprocessing, on a loaded machine: minutes at
# worst. A child past it is stuck (a hung import, a dataset on a dead mount).
CHILD_CHECK_TIMEOUT_S = 600.0


class ChildCheck:
    """A pre-flight check running in a child interpreter (``python -m harvest.preflight``),
    started at construction; its verdict read by :meth:`verdict` or :meth:`result`. The one
    way harvest runs a check in a child: the launcher's job check beside SGLang's start-up
    (:func:`start_job_check`) and the control endpoint's check of a submitted job file."""

    def __init__(self, arguments: list[str], what: str = "harvest's pre-flight check"):
        self.what = what
        self._process = subprocess.Popen([sys.executable, "-m", "harvest.preflight", *arguments],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def verdict(self, timeout_s: float = CHILD_CHECK_TIMEOUT_S) -> str | None:
        """Wait for the child: None when it passed, else why not (its PreflightError, or
        how it ended otherwise). A child still running after ``timeout_s`` is killed."""
        try:
            stdout, stderr = self._process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.communicate()
            return f"{self.what} did not finish within {timeout_s:.0f} s"
        if self._process.returncode == 0:
            return None
        return reported_error(stdout) or (f"{self.what} failed (exit status {self._process.returncode}): "
                                          f"{stderr.strip()[-2000:] or 'no output'}")

    def result(self, timeout_s: float = CHILD_CHECK_TIMEOUT_S) -> None:
        """Wait for the child; raise PreflightError with the reason it did not pass."""
        problem = self.verdict(timeout_s)
        if problem is not None:
            raise PreflightError(problem)


def start_job_check(config_path: str | os.PathLike | None, *, tp_size: int | None = None) -> ChildCheck:
    """:data:`JOB_CHECKS` in a child interpreter, started now, for a process that must not
    start CUDA: LlamaFactory's TrainingArguments set up the device (``torch.cuda.set_device``
    on a GPU machine), which in SGLang's launcher (it goes on as the server's tokenizer)
    would hold a CUDA context on the first GPU for the server's whole life. The child pays
    the imports of torch, transformers and LlamaFactory again: seconds the launcher spends
    starting its schedulers meanwhile (docs/measurements.md)."""
    arguments = ["--jobs-only"]
    if config_path is not None:
        arguments += ["--config", str(config_path)]
    if tp_size is not None:
        arguments += ["--tp-size", str(tp_size)]
    return ChildCheck(arguments)


_REPORT_KEY = "preflight_error"


def check_job_file(path: str | os.PathLike, *, tp_size: int = 1) -> None:
    """One job file as a server checks it before it runs (a run-time submission): its
    name and harvest section, then `harvest train --check`'s checks with the server's caps
    and its tensor-parallel degree ``tp_size``."""
    from harvest.train.errors import CheckpointError, JobError
    from harvest.train.job import job_identity, load_job
    from harvest.train.plan import check_job

    try:
        job_identity(path)
        check_job(load_job(path, in_server=True), tp_size=tp_size)
    except (JobError, CheckpointError) as exc:  # names the job file, then the key or the checkpoint
        raise PreflightError(str(exc)) from None


def reported_error(stdout: str) -> str | None:
    """The child's PreflightError: its last stdout line (libraries may print before it)."""
    lines = stdout.strip().splitlines()
    if not lines:
        return None
    try:
        report = json.loads(lines[-1])
    except ValueError:
        return None
    return report.get(_REPORT_KEY) if isinstance(report, dict) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harvest.preflight",
                                     description="harvest's pre-flight check, run by check_in_child")
    parser.add_argument("--config", default=None, help="harvest.yaml (default: built-in defaults)")
    parser.add_argument("--model-path", default=None, help="the served checkpoint")
    parser.add_argument("--sglang-host", default=None, help="SGLang's --host")
    parser.add_argument("--tp-size", type=int, default=None, help="SGLang's --tp-size (with --job: the server's)")
    parser.add_argument("--job", default=None, help="check this one job file instead (a run-time submission)")
    parser.add_argument("--jobs-only", action="store_true", help="only harvest.yaml's job files (JOB_CHECKS)")
    args = parser.parse_args(argv)
    try:
        if args.job is not None:
            check_job_file(args.job, tp_size=args.tp_size or 1)
        else:
            check(args.config, model_path=args.model_path, sglang_host=args.sglang_host, tp_size=args.tp_size,
                  checks=JOB_CHECKS if args.jobs_only else CHECKS)
    except PreflightError as exc:
        print(json.dumps({_REPORT_KEY: str(exc)}))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
