"""Where harvest's control endpoint listens, and starting its process from the engine
process (the endpoint itself: harvest.sglang.endpoint_server).

The endpoint process gets the command socket's other end as an inherited descriptor and
the API keys in its environment (never on its command line, which any local user can
read); it prints one line on stdout, ``ready <port>`` or why it could not listen, and then
serves until the command socket closes (the engine process ended).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import selectors
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harvest.logs import get_logger

logger = get_logger(__name__)

API_KEY_VAR = "HARVEST_CONTROL_API_KEY"
ADMIN_API_KEY_VAR = "HARVEST_CONTROL_ADMIN_API_KEY"
READY = "ready"
RUN_DIR_PREFIX = "harvest-control-"  # the snapshot's directory, removed by the endpoint when the engine is gone
_RUN_DIR_NAME = re.compile(re.escape(RUN_DIR_PREFIX) + r"(\d+)-")  # the engine process's pid, then mkdtemp's suffix
STALE_RUN_DIR_AGE_S = 60.0  # a live engine rewrites its snapshot every metrics.publish_interval_s (0.5 s)


@dataclasses.dataclass(frozen=True)
class EndpointSettings:
    host: str
    port: int
    backlog: int = 128  # Prometheus plus a few dashboards and scripts; 5 (the default) stalled 8 clients
    workers: int = 16  # threads serving connections; further connections wait in the backlog
    idle_timeout_s: float = 10.0  # an idle or slow connection is closed after this
    nice: int = 10  # nice increment of the endpoint process (metrics.endpoint_nice, default config.DEFAULT_ENDPOINT_NICE)


def endpoint_settings(metrics, sglang_host: str | None, source=None) -> tuple[EndpointSettings, str] | None:
    """Where the endpoint listens, and the setting that says so (for errors): the
    per-instance override (--harvest-metrics-port/-host, HARVEST_METRICS_PORT/_HOST)
    before harvest.yaml's ``metrics`` section; the host defaults to SGLang's --host.
    None when the port is 0 (endpoint off). ``metrics`` is a config.MetricsConfig."""
    from harvest import config_env

    port, host = config_env.metrics_port(), config_env.metrics_host()
    if port is not None:
        where = f"{config_env.METRICS_PORT_VAR} / --harvest-metrics-port"
    else:
        port = metrics.port
        where = "metrics.port" + (f" in {source}" if source else " (default)")
    if port == 0:
        return None
    host = host or metrics.host or sglang_host or "127.0.0.1"
    return EndpointSettings(host=host, port=port, nice=metrics.endpoint_nice), where


def create_run_dir(root: Path | None = None) -> tempfile.TemporaryDirectory:
    """The snapshot's directory for this engine process, named after its pid, after
    removing the directories of engines that are gone (:func:`remove_stale_run_dirs`)."""
    removed = remove_stale_run_dirs(root)
    if removed:
        logger.info("harvest: removed %d control directories left by servers that were killed (%s)", len(removed),
                    ", ".join(path.name for path in removed))
    return tempfile.TemporaryDirectory(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-", dir=root, ignore_cleanup_errors=True)


def remove_stale_run_dirs(root: Path | None = None, *, min_age_s: float = STALE_RUN_DIR_AGE_S) -> list[Path]:
    """Remove the snapshot directories whose engine is gone; return them.

    The endpoint removes its directory when the engine ends, but SGLang stops a server by
    killing its whole process tree (SIGKILL from the launcher, SIGTERM to the group from
    an init system), endpoint included, so nothing is left to remove it. A directory is
    stale when it is this user's, its name carries a pid (older versions' names do not:
    those are left alone), no process has that pid, and nothing in it changed for
    ``min_age_s``: the last condition keeps the directory of an engine in another pid
    namespace that shares this temporary folder."""
    root = Path(root) if root is not None else Path(tempfile.gettempdir())
    removed = []
    try:
        candidates = list(root.glob(RUN_DIR_PREFIX + "*"))
    except OSError:
        return removed
    now = time.time()
    for path in candidates:
        match = _RUN_DIR_NAME.match(path.name)
        if match is None:
            continue
        try:
            info = path.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or _process_exists(int(match.group(1))):
                continue
            newest = max([info.st_mtime] + [entry.stat(follow_symlinks=False).st_mtime for entry in os.scandir(path)])
        except OSError:  # gone meanwhile, or unreadable: not ours to judge
            continue
        if now - newest < min_age_s:
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OverflowError:  # not a pid at all: nothing runs under it
        return False
    return True


class ControlEndpointError(RuntimeError):
    """The endpoint could not start (its message names the setting: metrics.port, ...)."""


# --------------------------------------------------------------------------------------
# The engine process's side: start the endpoint process
# --------------------------------------------------------------------------------------
class EndpointProcess:
    """The endpoint process, started by the engine process. ``commands`` is the engine's
    end of the command socket (for harvest.colocate.control_link.ControlLink)."""

    def __init__(self, process: subprocess.Popen, commands: socket.socket, port: int):
        self.process = process
        self.commands = commands
        self.port = port

    @classmethod
    def start(cls, settings: EndpointSettings, snapshot_path: Path, *, api_key: str | None, admin_api_key: str | None,
              poll_interval_s: float, where: str, timeout_s: float = 60.0, tp_size: int = 1) -> "EndpointProcess":
        """Start it and wait until it listens. ``where`` names the setting the address came
        from, for the error (``metrics.port in harvest.yaml``, ``--harvest-metrics-port``)."""
        engine_end, endpoint_end = socket.socketpair()
        env = dict(os.environ)
        for var, value in ((API_KEY_VAR, api_key), (ADMIN_API_KEY_VAR, admin_api_key)):
            env.pop(var, None)
            if value:
                env[var] = value
        command = [sys.executable, "-m", "harvest.sglang.endpoint_server", "--host", settings.host, "--port", str(settings.port),
                   "--backlog", str(settings.backlog), "--workers", str(settings.workers),
                   "--idle-timeout-s", str(settings.idle_timeout_s), "--nice", str(settings.nice),
                   "--snapshot", str(snapshot_path), "--poll-interval-s", str(poll_interval_s),
                   "--commands-fd", str(endpoint_end.fileno()), "--tp-size", str(tp_size)]
        auth_module = _sglang_auth_module_path()
        if auth_module is not None:
            command += ["--auth-module", str(auth_module)]
        try:
            process = subprocess.Popen(command, env=env, pass_fds=(endpoint_end.fileno(),), stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE)
        finally:
            endpoint_end.close()
        line = _first_line(process, timeout_s)
        process.stdout.close()
        if not line.startswith(READY + " "):
            engine_end.close()
            _end(process)
            reason = line or f"the endpoint process exited with code {process.returncode} (its log is above)"
            raise ControlEndpointError(f"harvest's control endpoint on {settings.host}:{settings.port} ({where}): {reason}")
        return cls(process, engine_end, int(line.split()[1]))

    def close(self, timeout_s: float = 5.0) -> None:
        # The endpoint exits when the command socket closes (ControlLink.close); this only
        # makes sure of it.
        _end(self.process, timeout_s)


def _first_line(process: subprocess.Popen, timeout_s: float) -> str:
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout_s):
            return f"did not start within {timeout_s:.0f} s"
    return process.stdout.readline().decode(errors="replace").strip()


def _end(process: subprocess.Popen, timeout_s: float = 5.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _sglang_auth_module_path() -> Path | None:
    """The file of SGLang's auth rule, loaded by itself in the endpoint process: importing
    the ``sglang`` package there would cost ~9 s and hundreds of MB (it imports torch)."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "srt" / "utils" / "auth.py"
    return path if path.is_file() else None


def listen_address(host: str, port: int) -> tuple:
    """(family, type, proto, canonname, sockaddr) to listen on ``host``:``port``: the check
    and the endpoint resolve it alike (raises socket.gaierror when the host does not resolve)."""
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]


def check_bindable(host: str, port: int) -> str | None:
    """Why ``(host, port)`` cannot be listened on now, or None (the start-up check: the
    endpoint itself binds later, in the engine process, after the model has loaded)."""
    try:
        family, kind, proto, _, address = listen_address(host, port)
    except socket.gaierror as exc:
        return f"host {host!r} does not resolve ({exc.strerror})"
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the endpoint binds
        try:
            sock.bind(address)
        except OSError as exc:
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None
