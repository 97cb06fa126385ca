"""harvest's HTTP endpoint for metrics and trainer control, in a process of its own.

Serves ``/metrics`` and the ``/harvest/*`` routes (status, steps, pause, resume, stop, jobs,
settings) from its copy of the snapshot the engine publishes at most every
``metrics.publish_interval_s``; commands go to the engine through
:mod:`harvest.colocate.control_link` and run between steps, so no request waits on decode
and polling costs decode nothing. Runs at ``metrics.endpoint_nice`` with a fixed pool of
threads. The /harvest routes follow SGLang's admin auth rule; API keys arrive in the
environment, never on the command line.

Routes, replies and rules: docs/metrics.md, 'The endpoint'.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import math
import os
import queue
import re
import shutil
import socket
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from harvest.logs import get_logger
from harvest.sglang.control_endpoint import (ADMIN_API_KEY_VAR, API_KEY_VAR, READY, RUN_DIR_PREFIX, EndpointSettings,
                                             listen_address)

logger = get_logger(__name__)

STEPS_KEPT = 8192
STEPS_DEFAULT_LIMIT = 512  # a poll's default: ~75 kB, where all 8192 kept would be ~1.2 MB
COMMAND_TIMEOUT_S = 10.0
MAX_BODY_BYTES = 64 * 1024
JOB_CHECK_TIMEOUT_S = 600.0  # LlamaFactory's imports and the dataset's preprocessing, at the endpoint's nice value
GET_ROUTES = ("/metrics", "/harvest/status", "/harvest/steps", "/harvest/jobs")
POST_ROUTES = ("/harvest/pause", "/harvest/resume", "/harvest/stop", "/harvest/jobs", "/harvest/settings")
JOB_ACTION_ROUTE = re.compile(r"/harvest/jobs/([^/]+)/(cancel|publish)")


def post_action(path: str) -> tuple[str, dict] | None:
    """(engine action, arguments from the path) of a POST route; None: no such route."""
    if path in ("/harvest/pause", "/harvest/resume", "/harvest/stop"):
        return path.rsplit("/", 1)[1], {}
    if path == "/harvest/jobs":
        return "submit", {}
    if path == "/harvest/settings":
        return "set", {}
    match = JOB_ACTION_ROUTE.fullmatch(path)
    if match:
        return match.group(2), {"name": urllib.parse.unquote(match.group(1))}
    return None


def strict(value):
    """``value`` with every non-finite float as None: JSON has no NaN (Python's json
    writes a bare ``NaN`` that strict parsers, jq and browsers refuse)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(item) for item in value]
    return value


def json_bytes(value) -> bytes:
    return json.dumps(strict(value), allow_nan=False, separators=(",", ":")).encode()


class Snapshot:
    """The endpoint's copy of the engine's snapshot file, refreshed by a thread every
    ``poll_interval_s``; the steps of successive snapshots merged by sequence number."""

    def __init__(self, path: Path, poll_interval_s: float):
        self.path = path
        self.poll_interval_s = poll_interval_s
        self._lock = threading.Lock()
        self._stamp = None
        self.published_at: float | None = None
        self.status: dict | None = None
        self.metrics = b""
        self.fields: tuple = ()
        self.steps: collections.deque = collections.deque(maxlen=STEPS_KEPT)
        self.version = 0  # bumps per new snapshot: cached renderings key on it
        self._rendered: dict = {}

    def run(self) -> None:
        while True:
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - a bad snapshot must not end the endpoint
                logger.exception("control: could not read the snapshot %s", self.path)
            time.sleep(self.poll_interval_s)

    def refresh(self) -> None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return  # the engine has not published yet
        stamp = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if stamp == self._stamp:
            return
        document = json.loads(self.path.read_bytes())
        steps = document["steps"]
        rows = steps["rows"]
        with self._lock:
            self._stamp = stamp
            self.published_at = document["published_at"]
            self.status = strict(document["status"])
            self.metrics = document["metrics"].encode()
            self.fields = tuple(steps["fields"])
            newest = self.steps[-1][0] if self.steps else 0
            self.steps.extend(strict(row) for row in rows if row[0] > newest)
            self.version += 1
            self._rendered.clear()

    def status_document(self) -> dict | None:
        with self._lock:
            if self.status is None:
                return None
            return {**self.status, "snapshot_age_s": round(max(0.0, time.time() - self.published_at), 3)}

    def steps_document(self, since_seq: int | None, limit: int | None) -> bytes:
        key = (since_seq, limit)
        with self._lock:
            cached = self._rendered.get(key)
            if cached is None:
                rows = [row for row in self.steps if since_seq is None or row[0] > since_seq]
                if limit is not None:
                    rows = rows[len(rows) - limit:] if limit else []
                cached = json_bytes({"fields": self.fields, "steps": [dict(zip(self.fields, row)) for row in rows]})
                if len(self._rendered) < 64:  # a cache per snapshot, bounded against odd queries
                    self._rendered[key] = cached
            return cached


class CommandChannel:
    """Commands to the engine over the socket, one at a time; replies by id. The socket
    closing means the engine process is gone: this process ends too."""

    def __init__(self, sock: socket.socket, on_closed):
        self._sock = sock
        self._send_lock = threading.Lock()
        self._replies: dict = {}
        self._arrived = threading.Condition()
        self._next_id = 0
        self._on_closed = on_closed
        threading.Thread(target=self._read, name="commands", daemon=True).start()

    def _read(self) -> None:
        try:
            with self._sock.makefile("rb") as lines:
                for line in lines:
                    message = json.loads(line)
                    with self._arrived:
                        self._replies[message["id"]] = message
                        self._arrived.notify_all()
        except (OSError, ValueError):
            pass
        self._on_closed()

    def call(self, action: str, args: dict | None = None, timeout_s: float = COMMAND_TIMEOUT_S) -> tuple[int, dict]:
        command = {"id": None, "action": action}
        if args:
            command["args"] = args
        with self._send_lock:
            self._next_id += 1
            command_id = command["id"] = self._next_id
            try:
                self._sock.sendall((json.dumps(command) + "\n").encode())
            except OSError:
                return 503, {"error": "the serving process is gone"}
        with self._arrived:
            if not self._arrived.wait_for(lambda: command_id in self._replies, timeout_s):
                return 503, {"error": f"the serving process did not take the {action} within {timeout_s:.0f} s (a long "
                                      "step?); it stays queued and runs at its next step"}
            message = self._replies.pop(command_id)
        return message["code"], message["reply"]


def _load_auth(path: str | None):
    """SGLang's ``decide_request_auth`` and ``AuthLevel``, from its file alone (no sglang import)."""
    if path is None:
        return None
    spec = importlib.util.spec_from_file_location("harvest_sglang_auth", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class EndpointServer(HTTPServer):
    """A fixed pool of ``workers`` threads serves the accepted connections: when all are
    busy the accept loop waits and new connections queue in the kernel's backlog (no
    thread per connection: 200 slow clients cost no more threads than 2)."""

    allow_reuse_address = True

    def __init__(self, settings: EndpointSettings, handler):
        self.request_queue_size = settings.backlog
        self.address_family = listen_address(settings.host, settings.port)[0]
        super().__init__((settings.host, settings.port), handler)
        self._accepted: queue.Queue = queue.Queue(maxsize=settings.workers)
        for index in range(settings.workers):
            threading.Thread(target=self._serve_connections, name=f"http-{index}", daemon=True).start()

    def process_request(self, request, client_address):
        self._accepted.put((request, client_address))  # waits while every worker is busy

    def _serve_connections(self) -> None:
        while True:
            request, client_address = self._accepted.get()
            try:
                self.finish_request(request, client_address)
            except Exception:  # noqa: BLE001 - one connection's failure ends that connection only
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)

    def handle_error(self, request, client_address):
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            # A client that went away or stalled: its business, not a fault here.
            logger.debug("control: %s from %s", type(error).__name__, client_address)
            return
        logger.exception("control: request from %s failed", client_address)


def make_handler(snapshot: Snapshot, commands: CommandChannel, auth, api_key: str | None, admin_api_key: str | None,
                 idle_timeout_s: float, tp_size: int = 1):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive for scrapers; idle connections end after timeout
        timeout = idle_timeout_s
        server_version = "harvest-control"

        def _reply(self, code: int, body: bytes, content_type: str = "application/json", headers: tuple = ()) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in headers:
                self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, code: int, payload, headers: tuple = ()) -> None:
            self._reply(code, json_bytes(payload), headers=headers)

        def _allowed(self, path: str) -> bool:
            if auth is None:
                if api_key or admin_api_key:  # keys without SGLang's rule to check them: refuse, never open
                    self._json(503, {"error": "SGLang's auth rule is not available to check the API key"})
                    return False
                return True
            decision = auth.decide_request_auth(
                method=self.command, path=path, authorization_header=self.headers.get("Authorization"),
                api_key=api_key, admin_api_key=admin_api_key, auth_level=auth.AuthLevel.ADMIN_OPTIONAL,
            )
            if not decision.allowed:
                self._json(decision.error_status_code or 401, {"error": "unauthorized"})
            return decision.allowed

        def _route(self) -> tuple[str, dict]:
            parts = urllib.parse.urlsplit(self.path)
            return parts.path, urllib.parse.parse_qs(parts.query)

        def _wrong_method(self, path: str) -> None:
            allowed = ("GET, HEAD, POST" if path in GET_ROUTES and path in POST_ROUTES else "GET, HEAD"
                       if path in GET_ROUTES else "POST" if path in POST_ROUTES or JOB_ACTION_ROUTE.fullmatch(path)
                       else None)
            if allowed is None:
                self._json(404, {"error": f"no such endpoint {path}"})
            else:
                self._json(405, {"error": f"{path} takes {allowed}, not {self.command}"}, headers=(("Allow", allowed),))

        def do_GET(self):  # noqa: N802 (http.server naming)
            path, query = self._route()
            if path not in GET_ROUTES:
                self._wrong_method(path)
            elif path == "/metrics":
                self._reply(200, snapshot.metrics, "text/plain; version=0.0.4; charset=utf-8")
            elif self._allowed(path):
                if path in ("/harvest/status", "/harvest/jobs"):
                    status = snapshot.status_document()
                    if status is None:
                        self._json(503, {"error": "harvest is starting: no status published yet"})
                    elif path == "/harvest/jobs":
                        self._json(200, {"jobs": (status.get("trainer") or {}).get("jobs") or [],
                                         "snapshot_age_s": status["snapshot_age_s"]})
                    else:
                        self._json(200, status)
                else:
                    try:
                        since = _int_param(query, "since_seq")
                        limit = _int_param(query, "limit")
                        if limit is None and since is None:
                            limit = STEPS_DEFAULT_LIMIT
                    except ValueError as exc:
                        self._json(400, {"error": str(exc)})
                        return
                    self._reply(200, snapshot.steps_document(since, limit))

        do_HEAD = do_GET  # noqa: N815

        def do_POST(self):  # noqa: N802
            path, _ = self._route()
            length = self.headers.get("Content-Length") or "0"
            if not length.isdigit() or int(length) > MAX_BODY_BYTES:
                self.close_connection = True
                self._json(413, {"error": f"a body of at most {MAX_BODY_BYTES} bytes"})
                return
            body = self.rfile.read(int(length))  # read even when refused: keeps the connection usable
            routed = post_action(path)
            if routed is None:
                self._wrong_method(path)
                return
            if not self._allowed(path):
                return
            action, args = routed
            try:
                given = json.loads(body) if body.strip() else {}
            except ValueError as exc:
                self._json(400, {"error": f"the request body is not JSON: {exc}"})
                return
            if not isinstance(given, dict):
                self._json(400, {"error": "the request body must be a JSON object"})
                return
            args = {**given, **args}
            if action == "submit":
                problem = check_job_in_child(args.get("path"), tp_size)
                if problem is not None:
                    self._json(400, {"error": problem})
                    return
            self._json(*commands.call(action, args))

        def _other(self):
            self._wrong_method(self._route()[0])

        do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _other  # noqa: N815

        def log_message(self, fmt, *args):  # request lines and timeouts stay out of the server log
            logger.debug("control: " + fmt, *args)

    return Handler


def _int_param(query: dict, name: str) -> int | None:
    values = query.get(name)
    if not values:
        return None
    value = values[-1]
    if not value.isdigit():
        raise ValueError(f"{name} must be a non-negative integer, not {value!r}")
    return int(value)


def check_job_in_child(path, tp_size: int = 1) -> str | None:
    """Why the job file ``path`` would not run in this server, or None: `harvest train
    --check`'s checks with the server's caps and tensor-parallel degree ``tp_size``
    (harvest.preflight --job: what the build refuses before the model loads), in a child process
    (LlamaFactory's imports cost seconds and hundreds of MB, and must not happen in the
    engine process). The child has this process's priority (``metrics.endpoint_nice``)."""
    if not isinstance(path, str) or not path:
        return f"'path' must be the job file's absolute path on the server, got {path!r}"
    if not os.path.isabs(path):
        return f"'path' must be absolute (the server's working directory is not yours): {path}"
    from harvest.preflight import ChildCheck

    return ChildCheck(["--job", path, "--tp-size", str(tp_size)], what=f"the job check of {path}").verdict(
        JOB_CHECK_TIMEOUT_S)


def _lower_priority(nice: int) -> None:
    """Below decode and the trainer: ``nice`` (metrics.endpoint_nice) added to the nice
    value, before any thread starts (Linux's nice value is per thread; new threads inherit
    it). Not SCHED_IDLE, which this endpoint used to take: its scheduling weight is 3
    against a nice-0 thread's 1024 (nice 10: 110), so while decode and the trainer kept
    the cores busy (when an operator needs /metrics and /harvest/status most) a request
    took hundreds of times its CPU time and scrapes timed out. A nice value leaves decode
    the contended core's larger share and still serves; an idle endpoint takes nothing."""
    if nice > 0:
        os.nice(nice)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="harvest's control endpoint (started by the serving process)")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backlog", type=int, default=EndpointSettings.backlog)
    parser.add_argument("--workers", type=int, default=EndpointSettings.workers)
    parser.add_argument("--idle-timeout-s", type=float, default=EndpointSettings.idle_timeout_s)
    parser.add_argument("--nice", type=int, default=EndpointSettings.nice)
    parser.add_argument("--snapshot", type=Path, required=True)
    parser.add_argument("--poll-interval-s", type=float, required=True)
    parser.add_argument("--commands-fd", type=int, required=True)
    parser.add_argument("--auth-module", default=None)
    parser.add_argument("--tp-size", type=int, default=1, help="the server's tensor-parallel degree (job checks)")
    args = parser.parse_args(argv)
    settings = EndpointSettings(args.host, args.port, args.backlog, args.workers, args.idle_timeout_s, args.nice)
    _lower_priority(settings.nice)
    snapshot = Snapshot(args.snapshot, args.poll_interval_s)

    def engine_gone():
        # The engine process ended (or closed the channel): so does its endpoint, removing
        # the snapshot's directory (a killed engine could not).
        if args.snapshot.parent.name.startswith(RUN_DIR_PREFIX):
            shutil.rmtree(args.snapshot.parent, ignore_errors=True)
        os._exit(0)

    commands = CommandChannel(socket.socket(fileno=args.commands_fd), engine_gone)
    try:
        auth = _load_auth(args.auth_module)
    except Exception as exc:  # noqa: BLE001 - the first stdout line is the engine's error message
        print(f"cannot load SGLang's auth rule from {args.auth_module}: {exc}", flush=True)
        return 1
    handler = make_handler(snapshot, commands, auth, os.environ.get(API_KEY_VAR), os.environ.get(ADMIN_API_KEY_VAR),
                           settings.idle_timeout_s, args.tp_size)
    try:
        server = EndpointServer(settings, handler)
    except OSError as exc:
        print(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}", flush=True)
        return 1
    threading.Thread(target=snapshot.run, name="snapshot", daemon=True).start()
    print(f"{READY} {server.server_address[1]}", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # nobody reads stdout after the ready line
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
