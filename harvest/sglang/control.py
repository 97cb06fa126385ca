"""harvest's HTTP endpoint inside the scheduler process: metrics and trainer control.

Served on harvest.yaml's ``metrics.port`` by a daemon thread (the scheduler process is
where the trainer and the metrics live; SGLang's HTTP server runs in another process):

    GET  /metrics          Prometheus text format (open, as SGLang's own /metrics)
    GET  /harvest/status   JSON: trainer, SM level, memory, QoS counters
    GET  /harvest/steps    JSON: the last steps, rows of StepRecord (time, batch size, ms,
                           predicted ms, level, trainer ran, decode?, decision reason)
    POST /harvest/pause    trainer pauses at its next unit boundary; the lent KV memory
                           goes back to decode (memory.release_on_pause)
    POST /harvest/resume
    POST /harvest/stop     trainer checkpoints and stops; every lent chunk comes back and
                           nothing more is lent
    (409 for an action the trainer's state refuses: resume after stop, ...)

The /harvest endpoints use SGLang's own auth rule for admin endpoints
(``sglang.srt.utils.auth.decide_request_auth`` at ``ADMIN_OPTIONAL``): with no keys
configured they are open; with ``--api-key`` and/or ``--admin-api-key`` they require the
same Bearer token SGLang's admin endpoints require.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from harvest.logs import get_logger

logger = get_logger(__name__)


class Controllable(Protocol):
    def status(self) -> dict: ...
    # Each returns (HTTP status, reply): 409 for an action the trainer's state refuses.
    def pause_trainer(self) -> tuple[int, dict]: ...
    def resume_trainer(self) -> tuple[int, dict]: ...
    def stop_trainer(self) -> tuple[int, dict]: ...
    def metrics_exposition(self) -> bytes: ...
    def recent_steps(self) -> list: ...


class ControlServer:
    def __init__(self, target: Controllable, *, port: int, api_key: str | None, admin_api_key: str | None, host: str = "127.0.0.1"):
        from sglang.srt.utils.auth import AuthLevel, decide_request_auth

        actions = {"/harvest/pause": target.pause_trainer, "/harvest/resume": target.resume_trainer, "/harvest/stop": target.stop_trainer}

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, code: int, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _json(self, code: int, payload: dict) -> None:
                self._reply(code, json.dumps(payload).encode())

            def _allowed(self) -> bool:
                decision = decide_request_auth(
                    method=self.command, path=self.path, authorization_header=self.headers.get("Authorization"),
                    api_key=api_key, admin_api_key=admin_api_key, auth_level=AuthLevel.ADMIN_OPTIONAL,
                )
                if not decision.allowed:
                    self._json(decision.error_status_code or 401, {"error": "unauthorized"})
                return decision.allowed

            def do_GET(self):  # noqa: N802 (http.server naming)
                if self.path == "/metrics":
                    self._reply(200, target.metrics_exposition(), "text/plain; version=0.0.4; charset=utf-8")
                elif self.path == "/harvest/status":
                    if self._allowed():
                        self._json(200, target.status())
                elif self.path == "/harvest/steps":
                    if self._allowed():
                        self._json(200, {"steps": target.recent_steps()})
                else:
                    self._json(404, {"error": f"no such endpoint {self.path}"})

            def do_POST(self):  # noqa: N802
                action = actions.get(self.path)
                if action is None:
                    self._json(404, {"error": f"no such endpoint {self.path}"})
                elif self._allowed():
                    self._json(*action())

            def log_message(self, fmt, *args):  # keep request lines out of the server log
                logger.debug("control: " + fmt, *args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="harvest-control", daemon=True)

    def start(self) -> "ControlServer":
        self._thread.start()
        logger.info("harvest control and metrics on http://127.0.0.1:%d (/metrics, /harvest/status)", self.port)
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
