"""The control endpoint: routes, JSON replies, and SGLang's admin auth rule."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from harvest.sglang.control import ControlServer

pytestmark = pytest.mark.timeout(60)


class FakeRuntime:
    def __init__(self):
        self.calls = []

    def status(self):
        return {"trainer": {"state": "running"}}

    def pause_trainer(self):
        self.calls.append("pause")
        return 200, {"trainer": "pausing"}

    def resume_trainer(self):
        self.calls.append("resume")
        return 200, {"trainer": "running"}

    def stop_trainer(self):
        self.calls.append("stop")
        return 409, {"error": "the trainer has been stopped: nothing to stop"}

    def metrics_exposition(self):
        return b"harvest_x 1\n"

    def recent_steps(self):
        return [[1.0, 4, 3.5, 3.2, 0, True]]


def request(port, method, path, token=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, data=b"" if method == "POST" else None)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture
def open_server():
    runtime = FakeRuntime()
    server = ControlServer(runtime, port=0, api_key=None, admin_api_key=None).start()
    yield runtime, server.port
    server.close()


def test_routes_without_keys(open_server):
    runtime, port = open_server
    assert request(port, "GET", "/metrics") == (200, b"harvest_x 1\n")
    status, body = request(port, "GET", "/harvest/status")
    assert status == 200 and json.loads(body) == {"trainer": {"state": "running"}}
    for action, code in (("pause", 200), ("resume", 200), ("stop", 409)):
        status, body = request(port, "POST", f"/harvest/{action}")
        assert status == code, (action, body)  # the runtime's status passes through
    assert runtime.calls == ["pause", "resume", "stop"]
    status, body = request(port, "GET", "/harvest/steps")
    assert status == 200 and json.loads(body) == {"steps": [[1.0, 4, 3.5, 3.2, 0, True]]}
    assert request(port, "GET", "/harvest/nope")[0] == 404
    assert request(port, "POST", "/harvest/explode")[0] == 404


def test_admin_key_is_required_like_sglang_admin_endpoints():
    runtime = FakeRuntime()
    server = ControlServer(runtime, port=0, api_key="user-key", admin_api_key="admin-key").start()
    try:
        assert request(server.port, "GET", "/metrics")[0] == 200  # metrics stay open, as in SGLang
        assert request(server.port, "POST", "/harvest/pause")[0] == 401
        assert request(server.port, "POST", "/harvest/pause", token="user-key")[0] == 401
        assert request(server.port, "GET", "/harvest/status", token="wrong")[0] == 401
        assert request(server.port, "POST", "/harvest/pause", token="admin-key")[0] == 200
        assert runtime.calls == ["pause"]
    finally:
        server.close()
