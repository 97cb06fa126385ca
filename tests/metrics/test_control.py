"""The control endpoint process: routes, strict JSON, SGLang's admin auth rule, the
command channel to the engine, and what a production endpoint must survive (many
clients at once, idle and vanishing clients, a busy port, the engine going away)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from harvest.colocate.control_link import ControlLink
from harvest.sglang.endpoint_server import strict
from harvest.sglang.control_endpoint import ControlEndpointError, EndpointProcess, EndpointSettings, check_bindable

pytestmark = pytest.mark.timeout(120)

STEP_FIELDS = ["seq", "time_s", "batch_size", "measured_ms", "predicted_ms", "level", "trainer_ran", "is_decode", "reason"]


def strict_loads(body: bytes):
    """JSON as a strict parser reads it: NaN and Infinity are errors."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(body, parse_constant=refuse)


class FakeEngine:
    """The engine's side: publishes snapshots and serves commands from a thread, as the
    engine thread would between steps."""

    def __init__(self, endpoint: EndpointProcess, snapshot_path: Path, replies: dict):
        self.calls: list[str] = []
        self.args: list[dict] = []
        self.replies = replies
        self._wake = threading.Event()
        self.link = ControlLink(endpoint.commands, snapshot_path, self.execute, self._wake.set)
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def execute(self, action, args):
        self.calls.append(action)
        self.args.append(args)
        return self.replies[action]

    def _loop(self):
        while not self._stop:
            if self._wake.wait(0.05):
                self._wake.clear()
                self.link.serve_commands()

    def close(self):
        self._stop = True
        self.link.close()


def snapshot(rows, *, status=None, metrics="harvest_x 1\n"):
    return {"published_at": time.time(), "status": status or {"trainer": {"state": "running"}, "prediction_error": float("nan")},
            "steps": {"fields": STEP_FIELDS, "rows": rows}, "metrics": metrics}


def row(seq, predicted=3.2):
    return [seq, 1000.0 + seq, 4, 3.5, predicted, 0, True, True, "fits"]


def start(tmp_path, *, api_key=None, admin_api_key=None, replies=None, **settings):
    """An endpoint process and its fake engine. At this process's priority unless ``nice``
    is given: only the priority test tests the priority (on a machine other work keeps
    busy, a lowered endpoint is slower to answer, which no other test is about)."""
    settings.setdefault("nice", 0)
    snapshot_path = tmp_path / "snapshot.json"
    endpoint = EndpointProcess.start(EndpointSettings(host="127.0.0.1", port=0, **settings), snapshot_path,
                                     api_key=api_key, admin_api_key=admin_api_key, poll_interval_s=0.05,
                                     where="metrics.port in test")
    engine = FakeEngine(endpoint, snapshot_path, replies or {"pause": (200, {"trainer": "paused"}),
                                                             "resume": (200, {"trainer": "resumed"}),
                                                             "stop": (409, {"error": "nothing to stop"})})
    return endpoint, engine


@pytest.fixture
def endpoint(tmp_path):
    endpoint, engine = start(tmp_path)
    yield endpoint, engine
    engine.close()
    endpoint.close()


def request(port, method, path, token=None, body=None):
    data = body if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, data=data)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status, resp.read(), resp.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers


def wait_for(predicate, timeout_s=60.0):  # generous: it waits on another process, on a loaded machine too
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_routes_serve_the_published_snapshot_in_strict_json(endpoint):
    endpoint, engine = endpoint
    port = endpoint.port
    assert request(port, "GET", "/harvest/status")[0] == 503  # nothing published yet: starting
    engine.link.publish(snapshot([row(1), row(2, predicted=float("nan"))]))
    assert wait_for(lambda: request(port, "GET", "/harvest/status")[0] == 200)
    code, body, headers = request(port, "GET", "/metrics")
    assert (code, body) == (200, b"harvest_x 1\n") and headers["Content-Type"].startswith("text/plain")
    status = strict_loads(request(port, "GET", "/harvest/status")[1])
    assert status["trainer"] == {"state": "running"} and status["prediction_error"] is None
    assert 0 <= status["snapshot_age_s"] < 60
    steps = strict_loads(request(port, "GET", "/harvest/steps")[1])
    assert steps["fields"] == STEP_FIELDS
    assert [s["seq"] for s in steps["steps"]] == [1, 2]
    assert steps["steps"][0]["predicted_ms"] == 3.2 and steps["steps"][1]["predicted_ms"] is None  # NaN -> null
    assert steps["steps"][0]["reason"] == "fits" and steps["steps"][0]["trainer_ran"] is True

    # The next snapshot repeats step 2 (each carries the last two intervals): merged by seq.
    engine.link.publish(snapshot([row(2), row(3), row(4)]))
    assert wait_for(lambda: len(strict_loads(request(port, "GET", "/harvest/steps")[1])["steps"]) == 4)
    assert [s["seq"] for s in strict_loads(request(port, "GET", "/harvest/steps?since_seq=2")[1])["steps"]] == [3, 4]
    assert [s["seq"] for s in strict_loads(request(port, "GET", "/harvest/steps?limit=1")[1])["steps"]] == [4]
    assert request(port, "GET", "/harvest/steps?limit=-1")[0] == 400
    code, body, _ = request(port, "HEAD", "/metrics")
    assert code == 200 and body == b""


def test_wrong_method_is_405_with_allow_and_unknown_path_404(endpoint):
    endpoint, _ = endpoint
    port = endpoint.port
    code, body, headers = request(port, "GET", "/harvest/pause")
    assert code == 405 and headers["Allow"] == "POST" and "takes POST" in strict_loads(body)["error"]
    code, _, headers = request(port, "POST", "/metrics")
    assert code == 405 and headers["Allow"] == "GET, HEAD"
    assert request(port, "DELETE", "/harvest/status")[0] == 405
    assert request(port, "GET", "/harvest/nope")[0] == 404
    assert request(port, "POST", "/harvest/explode")[0] == 404
    assert request(port, "POST", "/harvest/pause", body=b"x" * (128 * 1024))[0] == 413


def test_actions_run_on_the_engine_and_their_status_passes_through(endpoint):
    endpoint, engine = endpoint
    for action, code in (("pause", 200), ("resume", 200), ("stop", 409)):
        status, body, _ = request(endpoint.port, "POST", f"/harvest/{action}")
        assert status == code, (action, body)
        assert strict_loads(body) == engine.replies[action][1]
    assert engine.calls == ["pause", "resume", "stop"]


def test_a_failing_action_answers_500_and_the_endpoint_goes_on(tmp_path):
    endpoint, engine = start(tmp_path)
    try:
        def explode(action, args):
            raise RuntimeError("boom")
        engine.link._execute = explode
        status, body, _ = request(endpoint.port, "POST", "/harvest/pause")
        assert status == 500 and "boom" in strict_loads(body)["error"]
        engine.link._execute = engine.execute
        assert request(endpoint.port, "POST", "/harvest/resume")[0] == 200
    finally:
        engine.close()
        endpoint.close()


def test_admin_key_is_required_like_sglang_admin_endpoints(tmp_path):
    endpoint, engine = start(tmp_path, api_key="user-key", admin_api_key="admin-key")
    try:
        port = endpoint.port
        assert request(port, "GET", "/metrics")[0] == 200  # metrics stay open, as in SGLang
        assert request(port, "POST", "/harvest/pause")[0] == 401
        assert request(port, "POST", "/harvest/pause", token="user-key")[0] == 401
        assert request(port, "GET", "/harvest/status", token="wrong")[0] == 401
        assert request(port, "GET", "/harvest/steps")[0] == 401
        assert request(port, "POST", "/harvest/pause", token="admin-key")[0] == 200
        assert engine.calls == ["pause"]
        # The keys travel in the environment, never on the command line.
        with open(f"/proc/{endpoint.process.pid}/cmdline", "rb") as f:
            assert b"admin-key" not in f.read()
    finally:
        engine.close()
        endpoint.close()


def test_many_clients_at_once_are_all_served(endpoint):
    endpoint, engine = endpoint
    engine.link.publish(snapshot([row(i) for i in range(1, 600)]))
    assert wait_for(lambda: request(endpoint.port, "GET", "/harvest/status")[0] == 200)
    paths = ["/metrics", "/harvest/status", "/harvest/steps"]
    results = []

    def client(index):
        for k in range(10):
            results.append(request(endpoint.port, "GET", paths[(index + k) % 3])[0])

    default = strict_loads(request(endpoint.port, "GET", "/harvest/steps")[1])["steps"]
    assert len(default) == 512 and default[-1]["seq"] == 599  # a poll gets the last 512 unless it asks
    assert len(strict_loads(request(endpoint.port, "GET", "/harvest/steps?since_seq=0")[1])["steps"]) == 599
    threads = [threading.Thread(target=client, args=(i,)) for i in range(48)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results.count(200) == 480


def threads_of(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_idle_connections_time_out_and_connection_threads_are_bounded(tmp_path, capfd):
    endpoint, engine = start(tmp_path, workers=4, idle_timeout_s=1.0)
    try:
        before = threads_of(endpoint.process.pid)
        idle = [socket.create_connection(("127.0.0.1", endpoint.port)) for _ in range(40)]
        time.sleep(0.5)
        assert threads_of(endpoint.process.pid) <= before + 4  # 40 idle clients, 4 connection threads
        idle[0].settimeout(10)
        assert idle[0].recv(1) == b""  # closed by the server after the idle timeout
        # Every waiting connection is served in turn once the idle ones time out.
        assert request(endpoint.port, "GET", "/metrics")[0] == 200
        for sock in idle:
            sock.close()
        # A client that asks and vanishes: no traceback in the log.
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", endpoint.port)) as sock:
                sock.sendall(b"GET /harvest/steps HTTP/1.1\r\nHost: x\r\n\r\n")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
        assert request(endpoint.port, "GET", "/metrics")[0] == 200
    finally:
        engine.close()
        endpoint.close()
    assert "Traceback" not in capfd.readouterr().err


def test_keep_alive_serves_several_requests_on_one_connection(endpoint):
    endpoint, _ = endpoint
    connection = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=10)
    for _ in range(3):
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        assert response.status == 200
        response.read()
    connection.close()


def test_the_endpoint_exits_with_the_engine_and_removes_the_snapshot(tmp_path):
    run_dir = tmp_path / "harvest-control-x"
    run_dir.mkdir()
    endpoint, engine = start(run_dir)
    engine.link.publish(snapshot([row(1)]))
    engine.close()  # the engine's end of the command socket closes, as when its process dies
    endpoint.process.wait(timeout=10)
    assert not run_dir.exists()


def _dead_pid() -> int:
    import subprocess

    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def _aged(path: Path, seconds: float) -> Path:
    then = time.time() - seconds
    for entry in [*path.iterdir(), path]:
        os.utime(entry, (then, then), follow_symlinks=False)
    return path


def _run_dir(root: Path, name: str, *, age_s: float) -> Path:
    path = root / name
    path.mkdir()
    (path / "snapshot.json").write_text("{}")
    return _aged(path, age_s)


def test_run_dirs_of_killed_engines_are_removed_and_no_other(tmp_path):
    """SGLang stops a server by killing its process tree, so the endpoint never removes its
    snapshot's directory; the next engine removes those whose engine is gone. Kept: a
    live engine's, one written to lately (an engine in another pid namespace), an older
    version's (no pid in its name), anything that is not a directory."""
    from harvest.sglang.control_endpoint import RUN_DIR_PREFIX, STALE_RUN_DIR_AGE_S, remove_stale_run_dirs

    dead, old = _dead_pid(), STALE_RUN_DIR_AGE_S + 5
    killed = _run_dir(tmp_path, f"{RUN_DIR_PREFIX}{dead}-abc123", age_s=old)
    empty = tmp_path / f"{RUN_DIR_PREFIX}{dead}-empty"  # killed before its first snapshot
    empty.mkdir()
    _aged(empty, old)
    kept = [
        _run_dir(tmp_path, f"{RUN_DIR_PREFIX}{os.getpid()}-live", age_s=old),
        _run_dir(tmp_path, f"{RUN_DIR_PREFIX}{dead}-fresh", age_s=0),
        _run_dir(tmp_path, f"{RUN_DIR_PREFIX}k2j4x9_q", age_s=old),  # an older version's name
    ]
    no_such_pid = _run_dir(tmp_path, f"{RUN_DIR_PREFIX}{10**30}-huge", age_s=old)  # past any pid: no process
    a_file = tmp_path / f"{RUN_DIR_PREFIX}{dead}-file"
    a_file.write_text("not a directory")
    (tmp_path / "unrelated").mkdir()
    removed = remove_stale_run_dirs(tmp_path)
    assert sorted(removed) == sorted([killed, empty, no_such_pid])
    assert not killed.exists() and not empty.exists() and not no_such_pid.exists()
    assert all(path.exists() for path in kept) and a_file.exists() and (tmp_path / "unrelated").exists()
    # A snapshot written lately keeps the folder even when the folder itself is old.
    fresh_inside = _run_dir(tmp_path, f"{RUN_DIR_PREFIX}{dead}-inside", age_s=old)
    (fresh_inside / "snapshot.json").write_text("{}")
    assert remove_stale_run_dirs(tmp_path) == [] and fresh_inside.exists()


def test_an_engine_names_its_run_dir_after_itself_and_sweeps_first(tmp_path, caplog):
    from harvest.sglang.control_endpoint import RUN_DIR_PREFIX, STALE_RUN_DIR_AGE_S, create_run_dir

    dead = _dead_pid()
    leftover = _run_dir(tmp_path, f"{RUN_DIR_PREFIX}{dead}-left", age_s=STALE_RUN_DIR_AGE_S + 5)
    with caplog.at_level("INFO", logger="harvest.sglang.control_endpoint"):
        run_dir = create_run_dir(tmp_path)
    try:
        path = Path(run_dir.name)
        assert path.parent == tmp_path and path.name.startswith(f"{RUN_DIR_PREFIX}{os.getpid()}-")
        assert not leftover.exists()
        assert f"removed 1 control directories left by servers that were killed ({leftover.name})" in caplog.text
    finally:
        run_dir.cleanup()


def _nice_and_policy(pid, tid):
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # field 3 (state) first
    return int(fields[19 - 3]), int(fields[41 - 3])  # nice, scheduling policy


def test_the_endpoint_runs_below_decode_at_its_nice_value_never_sched_idle(tmp_path):
    """metrics.endpoint_nice reaches the endpoint process and every thread it serves on;
    the ordinary scheduler (SCHED_OTHER), not SCHED_IDLE, which starved it on busy cores."""
    from harvest.config import MetricsConfig
    from harvest.sglang.control_endpoint import endpoint_settings

    assert MetricsConfig().endpoint_nice == EndpointSettings(host="h", port=1).nice == 10
    assert endpoint_settings(MetricsConfig(port=1, endpoint_nice=7), "127.0.0.1")[0].nice == 7
    expected = min(19, os.nice(0) + 7)  # an increment on the serving process's nice value
    endpoint, engine = start(tmp_path, nice=7)
    try:
        engine.link.publish(snapshot([row(1)]))
        assert wait_for(lambda: request(endpoint.port, "GET", "/harvest/status")[0] == 200)
        pid = endpoint.process.pid
        threads = os.listdir(f"/proc/{pid}/task")
        assert len(threads) > 1  # the snapshot thread and a connection's worker too
        assert {_nice_and_policy(pid, tid) for tid in threads} == {(expected, os.SCHED_OTHER)}
    finally:
        engine.close()
        endpoint.close()


def test_a_busy_port_fails_start_up_naming_the_setting(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert "cannot listen on 127.0.0.1:%d" % port in check_bindable("127.0.0.1", port)
        with pytest.raises(ControlEndpointError, match=rf"127.0.0.1:{port} \(metrics.port in harvest.yaml\).*in use"):
            EndpointProcess.start(EndpointSettings(host="127.0.0.1", port=port, nice=0), tmp_path / "s.json",
                                  api_key=None, admin_api_key=None, poll_interval_s=0.1,
                                  where="metrics.port in harvest.yaml")
    assert check_bindable("127.0.0.1", port) is None
    assert "does not resolve" in check_bindable("no-such-host.invalid", 1234)


def test_strict_turns_every_non_finite_number_into_null():
    value = {"a": float("nan"), "b": [1.0, float("inf"), {"c": -float("inf")}], "d": (2, "x")}
    assert strict(value) == {"a": None, "b": [1.0, None, {"c": None}], "d": [2, "x"]}
