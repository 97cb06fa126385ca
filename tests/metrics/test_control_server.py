"""harvest's endpoint on a real SGLang server (CPU): a process of its own, listening where
the per-instance override says, strict JSON on an ordinary server (prefill steps have no
prediction), and gone when the server is."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from harvest.sglang import server
from tests.colocate.test_sglang_colocation import _wait_for

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]


def strict_loads(body: bytes):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(body, parse_constant=refuse)


def _get(host, port, path):
    with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=10) as response:
        return response.read()


def _listening(port: int) -> set[str]:
    """The local addresses something listens on at ``port`` (from ss)."""
    out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True).stdout
    return {line.split()[3].rsplit(":", 1)[0] for line in out.splitlines() if line.strip()}


def _snapshot_dir_and_engine(endpoint_pid: int) -> tuple[Path, int]:
    """The folder of the endpoint's --snapshot and the endpoint's parent (the engine)."""
    with open(f"/proc/{endpoint_pid}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    with open(f"/proc/{endpoint_pid}/stat") as f:
        parent = int(f.read().rsplit(")", 1)[1].split()[1])
    return Path(argv[argv.index("--snapshot") + 1]).parent, parent


def test_the_endpoint_listens_where_the_instance_says_and_serves_strict_json(tiny_llama_path, tmp_path):
    yaml_port, instance_port = server.free_port(), server.free_port()
    config = tmp_path / "harvest.yaml"
    config.write_text(f"metrics: {{port: {yaml_port}}}\n")
    args = server.cpu_server_args(tiny_llama_path) + [
        "--enable-harvest", "--harvest-config", str(config),
        "--harvest-metrics-port", str(instance_port), "--harvest-metrics-host", "0.0.0.0"]
    with server.launch(args, log_path=tmp_path / "sglang.log") as srv:
        for i in range(6):  # prefills (no prediction: NaN inside) and decode steps
            srv.post("/generate", {"input_ids": [5 + i, 6, 7, 8], "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
        # The endpoint serves the newest snapshot the scheduler published: poll until one
        # holds those steps (one a publish interval old on an idle machine, later on a loaded one).
        steps = _wait_for(lambda: (s := strict_loads(_get("127.0.0.1", instance_port, "/harvest/steps")))
                          and {row["is_decode"] for row in s["steps"]} == {True, False} and s, timeout_s=60)
        assert steps, "no snapshot with both prefill and decode steps in 60 s"
        listening = _listening(instance_port)
        status = strict_loads(_get("127.0.0.1", instance_port, "/harvest/status"))
        metrics = _get("127.0.0.1", instance_port, "/metrics").decode()
        endpoints = srv.processes("harvest.sglang.endpoint_server")  # this server's only, not another test suite's
        yaml_port_used = _listening(yaml_port)
        run_dirs = {pid: _snapshot_dir_and_engine(pid) for pid in endpoints}
    assert listening == {"0.0.0.0"} and not yaml_port_used  # the command line won over harvest.yaml
    rows = steps["steps"]
    assert rows and set(rows[0]) == set(steps["fields"])
    prefill = [row for row in rows if not row["is_decode"]]
    assert prefill and all(row["predicted_ms"] is None for row in prefill)  # NaN -> null
    assert any(row["is_decode"] for row in rows)
    assert status["trainer"] is None and status["snapshot_age_s"] < 5
    assert "harvest_decode_step_seconds_count" in metrics
    assert len(endpoints) == 1  # one endpoint process for the instance ...
    # Its snapshot's folder carries the engine's pid: what lets the next server remove the
    # folder when this one is killed with its endpoint (control_endpoint.remove_stale_run_dirs).
    (run_dir, engine_pid), = run_dirs.values()
    assert run_dir.name.startswith(f"harvest-control-{engine_pid}-"), run_dir
    assert _wait_for(lambda: not srv.processes("harvest.sglang.endpoint_server"), timeout_s=60)  # ... gone with the server


def test_a_busy_metrics_port_stops_the_server_before_the_model_loads(tiny_llama_path, tmp_path):
    import socket

    with socket.socket() as busy:  # as NVIDIA's dcgm-exporter, or a second instance, would hold it
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = tmp_path / "harvest.yaml"
        config.write_text(f"metrics: {{port: {port}}}\n")
        args = server.cpu_server_args(tiny_llama_path) + ["--enable-harvest", "--harvest-config", str(config)]
        started = time.monotonic()
        with pytest.raises(server.ServerStartError):
            server.launch(args, log_path=tmp_path / "sglang.log", timeout_s=240)
        log = (tmp_path / "sglang.log").read_text(errors="replace")
    assert f"harvest's metrics endpoint (metrics.port in {config}): cannot listen on 127.0.0.1:{port}" in log
    assert "Load weight begin" not in log, log[-2000:]  # refused before the model loaded
    assert time.monotonic() - started < 120
