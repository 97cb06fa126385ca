"""CUDA_DEVICE_MAX_CONNECTIONS (issue 18, defect 4): harvest sets it to 32 wherever it owns
the process start, keeps an operator's value, and warns (doctor, the ladder's start-up)
when it gives harvest's streams fewer hardware queues than streams. CPU only: the checks
read the environment, and the ladder comes from the fakes of test_partitioner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harvest import config_env
from harvest.compute import device, green_partitioner, greenctx_lib
from harvest.ladder import Ladder
from tests.compute.test_partitioner import exact_split, fake_device, harvest_warnings, provisioned  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
VAR = "CUDA_DEVICE_MAX_CONNECTIONS"


def test_the_default_is_32_and_an_operators_value_wins():
    env: dict[str, str] = {}
    assert device.default_cuda_connections(env) == "32" and env == {VAR: "32"}
    env = {VAR: "12"}
    assert device.default_cuda_connections(env) == "12" and env == {VAR: "12"}


@pytest.mark.parametrize("env, connections", [({}, 8), ({VAR: "32"}, 32), ({VAR: "4"}, 4), ({VAR: "lots"}, 8),
                                              ({VAR: "0"}, 8)])
def test_connections_in_force(env, connections):
    assert device.cuda_connections(env) == connections


def test_stream_count_of_a_ladder():
    # 5 levels: 4 partial (decode + trainer) + the whole device's decode stream, + 2 beside.
    assert device.ladder_streams(5) == 9 + device.EXTRA_STREAMS
    assert device.ladder_streams(1, spatial=False) == 2 + device.EXTRA_STREAMS


def test_warning_names_the_value_the_streams_and_the_fix():
    problem = device.connections_problem(11, {})
    assert "CUDA_DEVICE_MAX_CONNECTIONS unset (driver default 8)" in problem
    assert "11 CUDA streams" in problem and "CUDA_DEVICE_MAX_CONNECTIONS=32" in problem
    assert "CUDA_DEVICE_MAX_CONNECTIONS=10:" in device.connections_problem(11, {VAR: "10"})
    assert device.connections_problem(11, {VAR: "11"}) is None
    assert device.connections_problem(8, {}) is None


def _built_ladder(monkeypatch, levels):
    class FakeLadder:
        def __init__(self, ordinal, decode_sms):
            self.green_stream_api = True
            self.ladder = provisioned(decode_sms)

        def close(self):
            pass

    import torch

    monkeypatch.setattr(greenctx_lib, "query_device", lambda ordinal: fake_device())
    monkeypatch.setattr(greenctx_lib, "split_preview", exact_split)
    monkeypatch.setattr(greenctx_lib, "LadderHandle", FakeLadder)
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda handle, device: ("stream", handle))
    return green_partitioner.GreenContextPartitioner(0, levels=levels)


def test_the_ladder_warns_at_start_up_when_connections_are_too_few(monkeypatch, harvest_warnings):  # noqa: F811
    monkeypatch.delenv(VAR, raising=False)
    partitioner = _built_ladder(monkeypatch, levels=5)  # 9 ladder streams + 2
    problems = [r.getMessage() for r in harvest_warnings if VAR in r.getMessage()]
    assert len(problems) == 1 and "11 CUDA streams" in problems[0], problems
    partitioner.close()
    harvest_warnings.clear()
    monkeypatch.setenv(VAR, "32")
    _built_ladder(monkeypatch, levels=5).close()
    assert not [r for r in harvest_warnings if VAR in r.getMessage()]


def test_the_check_counts_the_streams_the_ladder_has():
    whole = Ladder.whole_device(132, "fallback", decode_stream="d", trainer_stream="t")
    assert green_partitioner.warn_if_too_few_connections(whole, {}) is None  # 2 + 2 <= 8


def test_doctor_reports_the_value_and_warns_for_a_gpu_ladder():
    from harvest import doctor

    ladder = {"spatial": True, "levels": [{}] * 6}  # the doctor's default: 6 levels
    report = doctor.cuda_connections(ladder, {})
    assert report["env"] is None and report["connections"] == 8 and report["harvest_streams"] == 13
    assert "13 CUDA streams" in report["warning"]
    assert doctor.cuda_connections(ladder, {VAR: "32"})["warning"] is None
    assert doctor.cuda_connections(None, {}) == {"env": None, "connections": 8, "harvest_streams": 0, "warning": None}
    text = doctor.render_text({"harvest": "x", "python": "3", "platform": "p", "packages": {"torch_cuda": "13.0"},
                               "native_libraries": {}, "cuda_driver": {"present": True, "version": "13.0"},
                               "gpu_present": True, "gpus": [], "ladder": None, "cuda_connections": report})
    assert "CUDA_DEVICE_MAX_CONNECTIONS: unset (8 hardware queues for 13 harvest streams)" in text
    assert "WARNING: CUDA_DEVICE_MAX_CONNECTIONS unset" in text


@pytest.mark.parametrize("command, expected", [("doctor", None), ("replay", "32")])
def test_harvest_commands_that_start_cuda_set_it_and_doctor_does_not(monkeypatch, command, expected):
    import importlib

    from harvest import cli

    monkeypatch.delenv(VAR, raising=False)
    seen = []
    module = importlib.import_module(cli.COMMANDS[command])
    monkeypatch.setattr(module, "run", lambda args: seen.append(os.environ.get(VAR)) or 0)
    assert cli.main([command]) == 0 and seen == [expected]


def test_plugin_records_the_value_in_the_launcher_and_restores_it_in_a_scheduler(monkeypatch):
    from harvest.sglang import plugin

    class Args:
        enable_harvest, harvest_config = True, None

    for name in (VAR, config_env.CUDA_CONNECTIONS_VAR, config_env.ENABLED_VAR):
        monkeypatch.delenv(name, raising=False)
    seen = {}
    plugin._from_cli_args(lambda cls, args: seen.setdefault(VAR, os.environ.get(VAR)), object, Args())
    assert seen[VAR] == "32" and os.environ[config_env.CUDA_CONNECTIONS_VAR] == "32"
    monkeypatch.setenv(VAR, "8")  # what SGLang's launcher sets before it spawns the schedulers
    plugin._restore_cuda_connections()  # the scheduler's plugin load
    assert os.environ[VAR] == "32"
    # An operator's value travels instead of 32.
    monkeypatch.setenv(VAR, "16")
    monkeypatch.delenv(config_env.CUDA_CONNECTIONS_VAR)
    plugin._from_cli_args(lambda cls, args: None, object, Args())
    assert os.environ[config_env.CUDA_CONNECTIONS_VAR] == "16"


def test_a_server_without_harvest_is_left_alone(monkeypatch):
    from harvest.sglang import plugin

    class Args:
        enable_harvest, harvest_config = False, None

    for name in (VAR, config_env.CUDA_CONNECTIONS_VAR):
        monkeypatch.delenv(name, raising=False)
    plugin._from_cli_args(lambda cls, args: None, object, Args())
    plugin._restore_cuda_connections()
    assert VAR not in os.environ and config_env.CUDA_CONNECTIONS_VAR not in os.environ


def test_a_bad_recorded_value_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(config_env.CUDA_CONNECTIONS_VAR, "many")
    with pytest.raises(ValueError, match="HARVEST_CUDA_DEVICE_MAX_CONNECTIONS='many'"):
        config_env.cuda_connections()


def test_harvest_launch_sets_it_before_exec(monkeypatch):
    from harvest.sglang import launch

    monkeypatch.delenv(VAR, raising=False)
    execs = []
    monkeypatch.setattr(launch.os, "execv", lambda path, argv: execs.append(os.environ.get(VAR)))

    class Args:
        config, sglang_args = None, ["--model-path", "m"]

    assert launch.run(Args()) == 0 and execs == ["32"]


@pytest.mark.parametrize("script", ["scripts/colocate_gpu.py", "scripts/bench_vmm.py", "scripts/bench_trainer.py"])
def test_scripts_that_start_cuda_set_it_before_importing_torch(script):
    text = (ROOT / script).read_text()
    setting = text.index('os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")')
    assert setting < text.index("import torch"), script


def test_the_validation_script_exports_it():
    text = (ROOT / "scripts" / "gpu_validate.sh").read_text()
    assert "CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}" in text
