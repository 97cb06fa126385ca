"""The engine's end of harvest's control plane: a snapshot file it publishes, and the
operator's commands it runs between steps.

The HTTP endpoint (``harvest.sglang.endpoint_server``, a process of its own) and the engine meet
through a **snapshot file** (status, the recent steps and the Prometheus exposition,
written atomically at most every ``metrics.publish_interval_s``; every GET is served from
the endpoint's copy) and a **command socket** (one end of a socketpair: one JSON line per
operator action, ``{"id": 7, "action": "pause"}``; a reader thread here queues it, the
engine runs it at its next step or idle tick and writes the reply line
``{"id": 7, "code": 200, "reply": {...}}``). When this process dies the socket closes and
the endpoint process exits with it. Actions: harvest.colocate.job_control.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import threading
from pathlib import Path
from typing import Callable

from harvest.logs import get_logger

logger = get_logger(__name__)

SNAPSHOT_VERSION = 1


class ControlLink:
    """``execute(action, args) -> (HTTP status, reply)`` runs on the engine thread, from
    :meth:`serve_commands`, which the engine calls when ``request_attention`` was asked."""

    def __init__(self, sock: socket.socket, snapshot_path: Path, execute: Callable[[str, dict], tuple[int, dict]],
                 request_attention: Callable[[], None]):
        self.snapshot_path = Path(snapshot_path)
        self._sock = sock
        self._execute = execute
        self._request_attention = request_attention
        self._commands: collections.deque[dict] = collections.deque()
        self._closed = False
        self._reader = threading.Thread(target=self._read_commands, name="harvest-control-commands", daemon=True)
        self._reader.start()

    # -- snapshot (engine thread) -------------------------------------------------------
    def publish(self, snapshot: dict) -> None:
        """Replace the snapshot file atomically: a reader sees the old document or the new
        one, never half of one. NaN stays NaN here (the endpoint turns it into null):
        the engine thread pays for one ``json.dumps`` and one write, nothing more."""
        document = json.dumps({"version": SNAPSHOT_VERSION, **snapshot}, separators=(",", ":"))
        temporary = self.snapshot_path.with_name(self.snapshot_path.name + ".tmp")
        temporary.write_text(document)
        os.replace(temporary, self.snapshot_path)

    # -- commands -----------------------------------------------------------------------
    def _read_commands(self) -> None:
        try:
            with self._sock.makefile("rb") as lines:
                for line in lines:
                    try:
                        command = json.loads(line)
                    except ValueError:
                        logger.warning("control: a command line that is not JSON: %r", line[:200])
                        continue
                    self._commands.append(command)
                    self._request_attention()
        except OSError:
            pass  # closed under us: the engine is shutting down
        if not self._closed:
            logger.warning("control: the endpoint process closed its command channel; operator commands end here")

    def serve_commands(self) -> int:
        """Engine thread: run the queued commands and reply to each; how many ran."""
        served = 0
        while self._commands:
            served += 1
            command = self._commands.popleft()
            action = command.get("action")
            try:
                code, reply = self._execute(action, command.get("args") or {})
            except Exception as exc:  # noqa: BLE001 - the reply says what failed; serving goes on
                logger.exception("control: %s failed", action)
                code, reply = 500, {"error": f"{action} failed: {exc}"}
            self._reply({"id": command.get("id"), "code": code, "reply": reply})
        return served

    def _reply(self, message: dict) -> None:
        try:
            self._sock.sendall((json.dumps(message) + "\n").encode())
        except OSError as exc:
            logger.warning("control: could not reply to the endpoint process (%s)", exc)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
