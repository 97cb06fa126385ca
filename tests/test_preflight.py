"""harvest's pre-flight check: every bad input stops `harvest launch` (exit status 2, one
message, no traceback, nothing exec'd) and the plugin's launcher hooks (HarvestStartupError:
from ``ServerArgs.from_cli_args``, SGLang not started, or, for a job file where a CUDA
driver exists, from the launcher's wait for its schedulers, SGLang not serving), naming
harvest.yaml, the field and the file it names. Both launchers run in this process: `harvest launch` with os.execv
recorded, the plugin's hooks with stand-ins for SGLang's own functions."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import yaml

from harvest import cli, colocation_config, config_env, preflight
from harvest.compute import device
from harvest.preflight import PreflightError
from harvest.sglang import launch, plugin


def _edit_yaml(path: Path, **values) -> None:
    data = yaml.safe_load(path.read_text())
    data.update(values)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def _junk_profile(directory: Path, config: Path) -> None:
    (directory / "p.json").write_text("not json {")
    _edit_yaml(config, profile="p.json")


def _directory_as_profile(directory: Path, config: Path) -> None:
    (directory / "p.json").mkdir()
    _edit_yaml(config, profile="p.json")


def _profile_with_a_bad_field(directory: Path, config: Path) -> None:
    profile = json.loads(colocation_config.CPU_PROFILE.read_text())
    profile["samples"][0]["level"] = 99
    (directory / "p.json").write_text(json.dumps(profile))
    _edit_yaml(config, profile="p.json")


def _job_with_a_bad_rank(directory: Path, config: Path) -> None:
    _edit_yaml(directory / "job.yaml", lora_rank=-1)


def _job_whose_template_outgrows_the_vocabulary(directory: Path, config: Path) -> None:
    _edit_yaml(directory / "job.yaml", template="qwen")  # found by the job check, not the parser


def _job_with_an_empty_data_file(directory: Path, config: Path) -> None:
    (directory / "empty").mkdir()
    (directory / "empty" / "dataset_info.json").write_text('{"empty": {"file_name": "empty.json"}}')
    (directory / "empty" / "empty.json").write_text("[]")
    _edit_yaml(directory / "job.yaml", dataset="empty", dataset_dir=str(directory / "empty"))


def _job_on_a_device_this_machine_lacks(directory: Path, config: Path) -> None:
    job = yaml.safe_load((directory / "job.yaml").read_text())
    _edit_yaml(directory / "job.yaml", harvest={**job["harvest"], "device": "cuda:99"})  # what the build refuses


def _job_with_a_torn_checkpoint(directory: Path, config: Path) -> None:
    (directory / "adapter" / "checkpoint-3").mkdir(parents=True)  # the run would resume it: refused


def _missing_job(directory: Path, config: Path) -> None:
    _edit_yaml(config, jobs=["job.yaml", "gone.yaml"])


def _directory_as_job(directory: Path, config: Path) -> None:
    (directory / "jobs").mkdir()
    _edit_yaml(config, jobs=["jobs"])


def _second_of_two_jobs_bad(directory: Path, config: Path) -> None:
    job = yaml.safe_load((directory / "job.yaml").read_text())
    (directory / "job2.yaml").write_text(yaml.safe_dump({**job, "lora_rank": -1}))
    _edit_yaml(config, jobs=["job.yaml", "job2.yaml"])


# (how the setup is broken, what the message says after "harvest config <harvest.yaml>: ")
BAD_INPUTS = {
    "junk profile": (_junk_profile, "profile: {dir}/p.json: profile is not valid JSON: Expecting value"),
    "directory as profile": (_directory_as_profile, "profile: cannot read profile {dir}/p.json: Is a directory"),
    "profile with a bad field": (_profile_with_a_bad_field, "profile: {dir}/p.json: profile.samples[0].level=99: "),
    "job with lora_rank -1": (_job_with_a_bad_rank,
                              "jobs[0]: job file '{dir}/job.yaml': lora_rank: must be an integer > 0, got -1"),
    "job template outgrows the vocabulary": (
        _job_whose_template_outgrows_the_vocabulary,
        "jobs[0]: job file '{dir}/job.yaml': template: 'qwen' needs tokens the model's vocabulary lacks"),
    "job with an empty data file": (
        _job_with_an_empty_data_file,
        "jobs[0]: job file '{dir}/job.yaml': dataset: 'empty' has no samples: '{dir}/empty/empty.json' is empty"),
    "job on a device this machine lacks": (
        _job_on_a_device_this_machine_lacks,
        "jobs[0]: job file '{dir}/job.yaml': harvest.device: 'cuda:99' requested but "),
    "job with a torn checkpoint": (
        _job_with_a_torn_checkpoint,
        "jobs[0]: job file '{dir}/job.yaml': checkpoint '{dir}/adapter/checkpoint-3' has no harvest_state.json"),
    "missing job": (_missing_job, "jobs[1]='gone.yaml': expected an existing file; not found: {dir}/gone.yaml; "),
    "directory as job": (_directory_as_job, "jobs[0]: job file '{dir}/jobs' is not a file"),
    "second of two jobs bad": (_second_of_two_jobs_bad,
                               "jobs[1]: job file '{dir}/job2.yaml': lora_rank: must be an integer > 0, got -1"),
}


@pytest.fixture
def setup_dir(tmp_path):
    return tmp_path / "setup"


@pytest.fixture(autouse=True)
def no_cuda_driver(monkeypatch):
    """The plugin's hooks as on a machine without a CUDA driver (every check in the
    launcher) whatever this machine has; `cuda_driver` makes it one with a driver."""
    monkeypatch.setattr(device, "cuda_driver_present", lambda: False)


@pytest.fixture
def cuda_driver(monkeypatch):
    """As on a GPU server: the job check runs in a child, awaited before SGLang serves."""
    monkeypatch.setattr(device, "cuda_driver_present", lambda: True)


def _broken_setup(setup_dir: Path, model: Path, case: str) -> tuple[Path, str]:
    """harvest.yaml of the tiny model's ready setup, broken as ``case`` says; the message expected."""
    config = colocation_config.write(setup_dir, model)
    breaking, message = BAD_INPUTS[case]
    breaking(setup_dir, config)
    return config, f"harvest config {config}: " + message.format(dir=setup_dir)


def _harvest_launch(monkeypatch, capsys, argv: list[str]) -> tuple[int, str, list]:
    execs = []
    monkeypatch.setattr(launch.os, "execv", lambda path, args: execs.append(args))
    rc = cli.main(["launch", *argv])
    return rc, capsys.readouterr().err, execs


def _plugin_hook(config: Path | None, model: Path | str, started: list | None = None, **sglang_args):
    """SGLang's launcher parsing its arguments (the plugin's hook around from_cli_args),
    then waiting for its schedulers (the hook that awaits the job check); what SGLang got
    to do is appended to ``started``."""
    args = argparse.Namespace(enable_harvest=True, harvest_config=None if config is None else str(config),
                              model_path=str(model), **sglang_args)
    started = [] if started is None else started
    plugin._from_cli_args(lambda cls, parsed: started.append(parsed) or "server args", object, args)
    plugin._await_job_check(lambda: started.append("schedulers ready"))
    return started


def _refused_by_the_job_check(case: str) -> bool:
    """The cases the launcher's own checks pass and the job check refuses."""
    return BAD_INPUTS[case][1].startswith("jobs[") and "job file" in BAD_INPUTS[case][1]


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_harvest_launch_refuses_before_exec_naming_file_and_field(case, tiny_llama_path, setup_dir, monkeypatch,
                                                                   capsys):
    config, message = _broken_setup(setup_dir, tiny_llama_path, case)
    rc, err, execs = _harvest_launch(monkeypatch, capsys, ["--config", str(config), "--", "--model-path",
                                                           str(tiny_llama_path)])
    assert rc == 2 and execs == []
    assert "Traceback" not in err
    ours = [line for line in err.splitlines() if line.startswith("harvest launch:")]
    assert len(ours) == 1 and ours[0].startswith(f"harvest launch: {message}"), err


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_the_plugin_refuses_to_start_sglang_naming_file_and_field(case, tiny_llama_path, setup_dir):
    # No CUDA driver: every check runs in the launcher before SGLang starts anything.
    config, message = _broken_setup(setup_dir, tiny_llama_path, case)
    started = []
    with pytest.raises(plugin.HarvestStartupError) as refused:
        _plugin_hook(config, tiny_llama_path, started)
    assert str(refused.value).startswith(message)
    assert config_env.ENABLED_VAR not in os.environ and started == []  # nothing handed to SGLang


# With a driver, one case the launcher refuses itself and one the job check refuses: the
# child runs `check` on JOB_CHECKS, the functions run in-process above on every case (a
# child per case would cost seconds each for no other path).
@pytest.mark.parametrize("case", ["junk profile", "second of two jobs bad"])
def test_with_a_cuda_driver_a_bad_job_file_is_refused_before_sglang_serves(case, tiny_llama_path, setup_dir,
                                                                          cuda_driver):
    config, message = _broken_setup(setup_dir, tiny_llama_path, case)
    started = []
    with pytest.raises(plugin.HarvestStartupError) as refused:
        _plugin_hook(config, tiny_llama_path, started)
    assert str(refused.value).startswith(message)
    if _refused_by_the_job_check(case):
        # The job check ran in its child while the schedulers started: SGLang parsed its
        # arguments (its schedulers start); the wait for them never ran.
        assert os.environ[config_env.ENABLED_VAR] == "1"
        assert len(started) == 1 and "schedulers ready" not in started
    else:
        assert config_env.ENABLED_VAR not in os.environ and started == []


def test_a_good_setup_passes_and_is_launched(tiny_llama_path, setup_dir, monkeypatch, capsys):
    config = colocation_config.write(setup_dir, tiny_llama_path)
    rc, err, execs = _harvest_launch(monkeypatch, capsys, ["--config", str(config), "--", "--model-path",
                                                           str(tiny_llama_path)])
    assert rc == 0, err
    assert execs and execs[0][1:3] == ["-m", "sglang.launch_server"]
    assert execs[0][-3:] == ["--enable-harvest", "--harvest-config", str(config)]
    # The plugin's hooks pass it too and let SGLang start and serve: every check in the
    # launcher without a CUDA driver, the job check in a child with one.
    assert len(_plugin_hook(config, tiny_llama_path)) == 2
    assert os.environ[config_env.CONFIG_VAR] == str(config)
    monkeypatch.setattr(device, "cuda_driver_present", lambda: True)
    assert _plugin_hook(config, tiny_llama_path)[1:] == ["schedulers ready"]


def _process_state() -> tuple:
    """What a check in a process that goes on (SGLang's launcher, a scheduler) must leave
    as it was: the random generators' next draws, torch's global settings."""
    import random

    import numpy as np
    import torch

    return (random.random(), float(np.random.rand()), float(torch.rand(1)), torch.get_default_dtype(),
            torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())


def test_the_launchers_job_check_leaves_its_generators_as_it_found_them(tiny_llama_path, setup_dir):
    # LlamaFactory's parser seeds every generator with the job's seed: two launchers whose
    # jobs both had seed 0 drew the same "random" internal port and one server failed.
    import random

    import numpy as np
    import torch

    config = colocation_config.write(setup_dir, tiny_llama_path)

    def seeded():
        random.seed(1234)
        np.random.seed(1234)
        torch.manual_seed(1234)

    seeded()
    expected = _process_state()
    seeded()
    assert len(_plugin_hook(config, tiny_llama_path)) == 2  # every check ran here (no CUDA driver)
    assert _process_state() == expected


def _model_of_another_shape(tiny_llama_path: Path, directory: Path) -> Path:
    """A checkpoint directory whose config.json differs in a latency field (all a profile check reads)."""
    directory.mkdir()
    model_config = json.loads((tiny_llama_path / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**model_config, "num_hidden_layers": 7}))
    return directory


def test_a_profile_of_another_model_is_refused_unless_allowed(tiny_llama_path, setup_dir, tmp_path, monkeypatch,
                                                              capsys):
    other = _model_of_another_shape(tiny_llama_path, tmp_path / "other-model")
    config = colocation_config.write(setup_dir, tiny_llama_path)
    _edit_yaml(config, allow_profile_mismatch=False, jobs=[])
    message = (f"harvest config {config}: profile: {colocation_config.CPU_PROFILE} was measured for another model "
               f"(model: profile is for 'tiny-llama-h64-l2-a4-kv2-v512-s0-b1'")
    rc, err, execs = _harvest_launch(monkeypatch, capsys, ["--config", str(config), "--", f"--model={other}"])
    assert rc == 2 and execs == [] and f"harvest launch: {message}" in err
    with pytest.raises(plugin.HarvestStartupError, match=r"set allow_profile_mismatch: true"):
        _plugin_hook(config, other)
    # The profile's own model, and the override, pass.
    assert _harvest_launch(monkeypatch, capsys, ["--config", str(config), "--", "--model-path",
                                                 str(tiny_llama_path)])[0] == 0
    _edit_yaml(config, allow_profile_mismatch=True)
    assert _harvest_launch(monkeypatch, capsys, ["--config", str(config), "--", "--model-path", str(other)])[0] == 0


def _profile_at_tp(directory: Path, tp_size: int) -> Path:
    """The committed CPU profile as if measured with `harvest profile --tp tp_size`."""
    data = json.loads(colocation_config.CPU_PROFILE.read_text())
    data["schema_version"] = 3
    data["provenance"]["tp_size"] = tp_size
    path = directory / f"tp{tp_size}.json"
    path.write_text(json.dumps(data))
    return path


def test_a_profile_of_another_tp_degree_is_refused_unless_allowed(tiny_llama_path, setup_dir, monkeypatch, capsys):
    config = colocation_config.write(setup_dir, tiny_llama_path)
    profile = _profile_at_tp(setup_dir, 2)
    _edit_yaml(config, profile=str(profile), allow_profile_mismatch=False, jobs=[])
    with pytest.raises(plugin.HarvestStartupError) as refused:
        _plugin_hook(config, tiny_llama_path, tp_size=1)
    assert str(refused.value) == (
        f"harvest config {config}: profile: {profile} was measured at another tensor-parallel degree (TP degree: "
        "profile measured at tp=2, running tp=1 (`harvest profile --tp 1` measures one)); run `harvest profile --tp 1`, "
        "or set allow_profile_mismatch: true (predictions will be off)")
    with pytest.raises(plugin.HarvestStartupError, match=r"profile measured at tp=2, running tp=1"):
        _plugin_hook(config, tiny_llama_path)  # SGLang's parsed arguments always carry tp_size; absent, it is 1
    assert _plugin_hook(config, tiny_llama_path, tp_size=2) != []
    with pytest.raises(PreflightError, match=r"profile measured at tp=2, running tp=4"):
        preflight.check(config, model_path=str(tiny_llama_path), tp_size=4)
    preflight.check(config, model_path=str(tiny_llama_path))  # the degree unknown: not compared
    _edit_yaml(config, allow_profile_mismatch=True)
    assert _plugin_hook(config, tiny_llama_path, tp_size=1) != []


def test_jobs_are_checked_at_the_servers_tensor_parallel_degree(tiny_llama_path, setup_dir):
    """What a tp = 2 server's trainer would refuse is refused at launch and by ctl submit's check."""
    from harvest.sglang.endpoint_server import check_job_in_child

    config = colocation_config.write(setup_dir, tiny_llama_path)
    _edit_yaml(setup_dir / "job.yaml", optim="adafactor")
    job = setup_dir / "job.yaml"
    message = f"job file '{job}': optim: 'adafactor' does not update a shard as it would the whole tensor"
    preflight.check(config, model_path=str(tiny_llama_path), tp_size=1)
    with pytest.raises(PreflightError, match=rf"^harvest config {config}: jobs\[0\]: {message}"):
        preflight.check(config, model_path=str(tiny_llama_path), tp_size=2)
    assert check_job_in_child(str(job)) is None
    assert check_job_in_child(str(job), tp_size=2).startswith(message)


def test_a_bad_harvest_yaml_field_names_the_file(tmp_path, monkeypatch, capsys):
    config = tmp_path / "harvest.yaml"
    config.write_text("memory: {max_lend_fraction: 3}\n")
    rc, err, execs = _harvest_launch(monkeypatch, capsys, ["--config", str(config), "--", "--model-path", "m"])
    assert rc == 2 and execs == []
    assert err.startswith(f"harvest launch: harvest config {config}: memory.max_lend_fraction=3: expected ")
    with pytest.raises(plugin.HarvestStartupError, match=rf"^harvest config {config}: memory\.max_lend_fraction=3: "):
        _plugin_hook(config, "m")


def test_the_scheduler_runs_the_same_job_check(tiny_llama_path, setup_dir):
    """The composition root checks the job files again, with the pre-flight's own function."""
    from harvest.colocate.assemble import EngineAdapter, assemble
    from harvest.config import load

    config, message = _broken_setup(setup_dir, tiny_llama_path, "second of two jobs bad")
    with pytest.raises(PreflightError) as refused:
        assemble(load(config), EngineAdapter(device="cpu", model_path=str(tiny_llama_path), model_dtype="float32"))
    assert str(refused.value).startswith(message)


def test_a_child_that_fails_otherwise_is_reported_with_its_output(monkeypatch):
    from harvest import preflight

    monkeypatch.setattr(preflight.sys, "executable", shutil.which("false"))
    with pytest.raises(PreflightError, match=r"^harvest's pre-flight check failed \(exit status 1\): no output$"):
        preflight.start_job_check(None).result()


def test_a_child_still_running_at_its_timeout_is_killed_and_reported(monkeypatch, tmp_path):
    from harvest import preflight

    stuck = tmp_path / "stuck-interpreter"
    stuck.write_text("#!/bin/sh\nexec sleep 60\n")
    stuck.chmod(0o755)
    monkeypatch.setattr(preflight.sys, "executable", str(stuck))
    check = preflight.ChildCheck(["--jobs-only"], what="the job check of /srv/job.yaml")
    started = time.monotonic()
    assert check.verdict(timeout_s=1.0) == "the job check of /srv/job.yaml did not finish within 1 s"
    assert time.monotonic() - started < 30  # killed, not waited for
    assert check._process.poll() is not None


@pytest.mark.parametrize("argv, model_path", [
    (["--model-path", "m", "--device", "cpu"], "m"),
    (["--device", "cpu", "--model=m"], "m"),
    (["--device", "cpu"], None),  # e.g. given in SGLang's --config file: the plugin's hook checks it
    (["--model-path"], None),  # SGLang's parser refuses it
])
def test_the_served_model_is_read_from_sglangs_arguments(argv, model_path):
    assert launch.served_model_path(argv) == model_path


@pytest.mark.parametrize("argv, tp_size", [
    (["--model-path", "m", "--tp", "2"], 2),
    (["--tp-size=4", "--model-path", "m"], 4),
    (["--tensor-parallel-size", "8"], 8),
    (["--model-path", "m"], None),  # not given: SGLang's default, or its --config file's (the plugin's hook checks it)
])
def test_the_tensor_parallel_degree_is_read_from_sglangs_arguments(argv, tp_size):
    assert launch.sglang_flags(argv).tp_size == tp_size


@pytest.fixture
def busy_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture
def no_metrics_overrides(monkeypatch):
    monkeypatch.delenv(config_env.METRICS_PORT_VAR, raising=False)
    monkeypatch.delenv(config_env.METRICS_HOST_VAR, raising=False)


def test_a_busy_metrics_port_stops_the_start_naming_the_setting(tiny_llama_path, setup_dir, busy_port, monkeypatch,
                                                               capsys, no_metrics_overrides):
    config = colocation_config.write(setup_dir, tiny_llama_path, metrics_port=busy_port)
    _edit_yaml(config, jobs=[])  # the port is checked first; no LlamaFactory import needed to see it
    message = (f"harvest config {config}: harvest's metrics endpoint (metrics.port in {config}): cannot listen on "
               f"127.0.0.1:{busy_port}: Address already in use; give this instance another port with "
               "--harvest-metrics-port N")
    rc, err, execs = _harvest_launch(monkeypatch, capsys, ["--config", str(config), "--", "--model-path",
                                                           str(tiny_llama_path)])
    assert rc == 2 and execs == [] and err.startswith(f"harvest launch: {message}"), err
    with pytest.raises(plugin.HarvestStartupError) as refused:
        _plugin_hook(config, tiny_llama_path)
    assert str(refused.value).startswith(message)


def test_the_instance_port_on_the_command_line_is_the_one_checked(tiny_llama_path, setup_dir, busy_port, monkeypatch,
                                                                  capsys, no_metrics_overrides):
    from harvest.sglang.server import free_port

    config = colocation_config.write(setup_dir, tiny_llama_path, metrics_port=busy_port)
    _edit_yaml(config, jobs=[])
    free = free_port()
    argv = ["--config", str(config), "--", "--model-path", str(tiny_llama_path)]
    # harvest.yaml's busy port, overridden per instance by a free one: passes.
    rc, err, execs = _harvest_launch(monkeypatch, capsys, [*argv, "--harvest-metrics-port", str(free)])
    assert rc == 0 and execs, err
    # The other way round: a busy port on the command line stops it, naming the flag.
    _edit_yaml(config, metrics={"port": free})
    rc, err, _ = _harvest_launch(monkeypatch, capsys, [*argv, "--harvest-metrics-port", str(busy_port)])
    assert rc == 2 and "(HARVEST_METRICS_PORT / --harvest-metrics-port)" in err and f":{busy_port}: " in err, err
    # A value that is no port is refused, naming the flag.
    rc, err, _ = _harvest_launch(monkeypatch, capsys, [*argv, "--harvest-metrics-port", "http"])
    assert rc == 2 and "--harvest-metrics-port: 'http' is not a port (port must be 1-65535, or 0: off)" in err, err


def test_the_endpoint_host_defaults_to_sglangs(tiny_llama_path, setup_dir, monkeypatch, capsys, no_metrics_overrides):
    config = colocation_config.write(setup_dir, tiny_llama_path, metrics_port=1234)
    _edit_yaml(config, jobs=[])
    rc, err, _ = _harvest_launch(monkeypatch, capsys, ["--config", str(config), "--", "--model-path",
                                                       str(tiny_llama_path), "--host", "no-such-host.invalid"])
    assert rc == 2 and "host 'no-such-host.invalid' does not resolve" in err, err
