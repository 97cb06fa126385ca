"""The plugin's start-up contract, through SGLang's real launcher.

- `--enable-harvest --harvest-config bad.yaml` refuses to start, naming the field; a bad
  job file refuses before the server serves, naming the job file and the key.
- An unsupported SGLang version refuses to start when harvest is enabled, and leaves a
  server without `--enable-harvest` alone.
- `harvest launch` validates before exec'ing SGLang.
- A server configuration harvest refuses (harvest.sglang.refusals; here a KV page size
  of 16) stops start-up, naming the flag.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from harvest.sglang import launch
from harvest.sglang.server import cpu_server_env

# no_server: the launcher refuses before any SGLang process starts (tests/conftest.py runs
# these beside the server lane).
pytestmark = [pytest.mark.sglang, pytest.mark.timeout(300)]


def _launch_server(argv: list[str], *, fake_sglang_version: str | None = None, cuda_driver: bool | None = None,
                   timeout: float = 240):
    """Run sglang.launch_server's __main__ in a subprocess, optionally faking its version
    or, in the launcher, whether a CUDA driver is present."""
    code = textwrap.dedent(
        f"""
        import importlib.metadata as metadata, runpy, sys
        fake = {fake_sglang_version!r}
        if fake:
            real = metadata.version
            metadata.version = lambda dist: fake if dist == "sglang" else real(dist)
        if {cuda_driver!r} is not None:
            from harvest.compute import device
            device.cuda_driver_present = lambda: {cuda_driver!r}
        sys.argv = ["sglang.launch_server", *{argv!r}]
        runpy.run_module("sglang.launch_server", run_name="__main__")
        """
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=cpu_server_env())


@pytest.mark.no_server
def test_bad_config_refuses_to_start_naming_the_field(tiny_llama_path, tmp_path):
    bad = tmp_path / "harvest.yaml"
    bad.write_text("qos:\n  target_tpot_ms: -5\n")
    out = _launch_server(["--model-path", str(tiny_llama_path), "--device", "cpu", "--enable-harvest", "--harvest-config", str(bad)])
    assert out.returncode != 0
    assert "qos.target_tpot_ms=-5: expected a finite number > 0.0; " in out.stderr


@pytest.mark.parametrize("cuda_driver", [pytest.param(False, marks=pytest.mark.no_server), True],
                         ids=["no CUDA driver", "a CUDA driver"])
def test_a_bad_job_file_stops_start_up_before_serving_naming_the_key(cuda_driver, tiny_llama_path, tmp_path):
    # Without a driver the launcher checks the job before SGLang starts anything. With one
    # the job check runs in a child while the schedulers start; the launcher awaits it
    # before it serves, and SGLang's launcher ends its children (else this run would wait
    # on their open stderr until the timeout).
    import yaml

    from harvest import colocation_config
    from harvest.sglang import server

    config = colocation_config.write(tmp_path, tiny_llama_path)
    job = yaml.safe_load((tmp_path / "job.yaml").read_text())
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({**job, "lora_rank": -1}))
    out = _launch_server(server.cpu_server_args(tiny_llama_path) + ["--enable-harvest", "--harvest-config", str(config)],
                         cuda_driver=cuda_driver)
    assert out.returncode != 0
    assert f"HarvestStartupError: harvest config {config}: jobs[0]: job file '{tmp_path}/job.yaml': lora_rank: must be " \
        "an integer > 0, got -1" in out.stderr, out.stderr[-3000:]
    assert "The server is fired up" not in out.stderr
    if not cuda_driver:
        assert "Load weight begin" not in out.stderr  # refused before SGLang started anything


@pytest.mark.no_server
def test_config_without_enable_flag_is_refused(tiny_llama_path, tmp_path):
    good = tmp_path / "harvest.yaml"
    good.write_text("qos: {target_tpot_ms: 30}\n")
    out = _launch_server(["--model-path", str(tiny_llama_path), "--device", "cpu", "--harvest-config", str(good)])
    assert out.returncode != 0
    assert "--harvest-config given without --enable-harvest" in out.stderr


@pytest.mark.no_server
def test_unsupported_sglang_version_refuses_when_enabled(tiny_llama_path):
    out = _launch_server(["--model-path", str(tiny_llama_path), "--device", "cpu", "--enable-harvest"], fake_sglang_version="0.6.0")
    assert out.returncode != 0
    assert "harvest supports sglang==0.5.23, found 0.6.0" in out.stderr
    assert "HarvestStartupError" in out.stderr


@pytest.mark.no_server
def test_unsupported_version_without_harvest_is_only_logged(tiny_llama_path):
    # The launcher gets past argument parsing (our refusal point) and fails later for an
    # unrelated reason we provoke on purpose: a model path that does not exist.
    out = _launch_server(["--model-path", "/nonexistent/model", "--device", "cpu"], fake_sglang_version="0.6.0")
    assert "harvest plugin NOT active" in out.stderr
    assert "HarvestStartupError" not in out.stderr


def test_refused_server_configuration_stops_start_up_naming_the_flag(tiny_llama_path):
    # Page size 16: SGLang's paged allocator, whose free list holds page ids, not token
    # slots (before the refusal, harvest's first idle tick crashed the scheduler).
    from harvest.sglang import server

    out = _launch_server(server.cpu_server_args(tiny_llama_path) + ["--page-size", "16", "--enable-harvest"])
    assert out.returncode != 0
    assert "UnsupportedServer: harvest cannot run on this server: KV page size 16 (PagedTokenToKVPoolAllocator" in out.stderr
    assert "run with --page-size 1" in out.stderr


@pytest.mark.no_server
def test_launch_builds_the_sglang_command():
    command = launch.build_command("h.yaml", ["--model-path", "m"])
    assert command[1:] == ["-m", "sglang.launch_server", "--model-path", "m", "--enable-harvest", "--harvest-config", "h.yaml"]
    assert launch.build_command(None, ["--enable-harvest"])[-1] == "--enable-harvest"
    with pytest.raises(ValueError, match="not both"):
        launch.build_command("a.yaml", ["--harvest-config", "b.yaml"])


@pytest.mark.no_server
def test_harvest_launch_validates_before_exec(tmp_path):
    bad = tmp_path / "harvest.yaml"
    bad.write_text("memory: {max_lend_fraction: 3}\n")
    out = subprocess.run(
        [sys.executable, "-m", "harvest.cli", "launch", "--config", str(bad), "--", "--model-path", "m"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2
    assert "memory.max_lend_fraction=3: expected a finite number in [0.0, 1.0]" in out.stderr


def test_scheduler_processes_get_harvests_cuda_connections_back(tiny_llama_path, tmp_path):
    """SGLang's launcher sets CUDA_DEVICE_MAX_CONNECTIONS=8 before it spawns its processes;
    with harvest enabled each of them (scheduler, detokenizer) starts with the operator's
    value again, here 16 (32 when unset)."""
    from harvest.sglang import server

    env = {**cpu_server_env(), "CUDA_DEVICE_MAX_CONNECTIONS": "16"}
    log = tmp_path / "server.log"
    with server.launch(server.cpu_server_args(tiny_llama_path) + ["--enable-harvest"], log_path=log, env=env,
                       timeout_s=240):
        pass
    restored = [line for line in log.read_text(errors="replace").splitlines()
                if "CUDA_DEVICE_MAX_CONNECTIONS=16 for harvest's streams (was 8)" in line]
    assert len(restored) >= 1, log.read_text(errors="replace")[-3000:]
