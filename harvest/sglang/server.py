"""Start, probe and stop an SGLang HTTP server in a subprocess (demo, tests, benchmarks).

The server runs in its own process group so that stopping it also ends the scheduler
and detokenizer processes SGLang forks; its output goes to a log file whose tail is
quoted when start-up fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def cpu_server_args(model_path: str | Path, *, decode_instance: bool = False, max_total_tokens: int = 16384) -> list[str]:
    """SGLang flags that serve ``model_path`` on CPU (why each: docs/sglang-integration.md,
    "SGLang on a CPU"); the process also needs :func:`cpu_server_env`."""
    args = [
        "--model-path", str(model_path),
        "--device", "cpu",
        "--attention-backend", "torch_native",  # x86 default is intel_amx, absent here
        "--grammar-backend", "none",
        "--dtype", "float32",
        "--max-total-tokens", str(max_total_tokens),
        "--disable-cuda-graph",
        "--skip-server-warmup",
    ]
    if decode_instance:
        args += [
            "--disaggregation-mode", "decode",
            "--disaggregation-transfer-backend", "fake",
            "--disaggregation-decode-retraction-backup", "cpu_tensor",
        ]
    return args


def cpu_server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1", DISABLE_VERSION_CHECK="1", TOKENIZERS_PARALLELISM="false")
    # A scheduler that ends on SIGTERM reads to SGLang's main process as a crash, and its
    # crash diagnostics (py-spy, CUDA core dumps: neither applies on CPU) first sleep 5 s:
    # every stop of a CPU server took 5 s longer than it needs.
    for var in ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH"):
        env.setdefault(var, "0")
    return env


# A port handed to a server that binds it only later (its HTTP port, harvest's metrics
# port) must not be one the OS can give an outgoing connection meanwhile: once, between
# the demo picking its metrics port and harvest binding it in the scheduler, the port was
# taken (the server's start-up opens connections of its own) and harvest's start-up
# failed with "Address already in use". So: below the kernel's ephemeral range, and
# below SGLang's own pick for its NCCL/gloo port (22000-29999, its
# get_free_port_below_ephemeral).
FREE_PORT_RANGE = (10000, 21999)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(attempts: int = 64) -> int:
    """A TCP port free now, outside the range outgoing connections take ports from."""
    low, high = FREE_PORT_RANGE[0], min(FREE_PORT_RANGE[1], _ephemeral_low() - 1)
    candidates = range(low, high + 1)
    # SystemRandom: processes that seeded the random module alike still pick apart.
    for port in random.SystemRandom().sample(candidates, min(attempts, len(candidates))):
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))  # any address: 127.0.0.1 listeners conflict too
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # all taken: whatever the OS hands out
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerStartError(RuntimeError):
    pass


@dataclasses.dataclass
class Server:
    process: subprocess.Popen
    base_url: str
    log_path: Path

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return "(no log)"

    def post(self, path: str, payload: dict, timeout: float = 120.0) -> dict:
        request = urllib.request.Request(
            self.base_url + path, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=timeout) as response:
                return response.status, response.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=timeout)

    def processes(self, module: str) -> set[int]:
        """The ids of this server's live processes running ``python -m <module>`` (e.g.
        ``harvest.sglang.endpoint_server``, harvest's endpoint) or titled ``<module>`` (SGLang's
        ``sglang::detokenizer``, ``sglang::scheduler_TP0``). Found by the session launch starts
        the server in, which every process it forks stays in even after its parent is gone:
        never another server's, whoever runs one on this machine."""
        session, marker = self.process.pid, module.encode()
        found = set()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
                if int(fields[3]) != session:  # state, ppid, pgrp, session
                    continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
            if marker in argv:  # an argument of its own (a zombie's command line is empty)
                found.add(int(entry))
        return found

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch(args: list[str], *, log_path: Path, port: int = 0, env: dict[str, str] | None = None, timeout_s: float = 300.0) -> Server:
    """Run ``python -m sglang.launch_server <args>`` and wait until it answers /health."""
    port = port or free_port()
    command = [sys.executable, "-m", "sglang.launch_server", *args, "--host", "127.0.0.1", "--port", str(port)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "wb")
    process = subprocess.Popen(
        command, stdout=log_file, stderr=subprocess.STDOUT, env=env or cpu_server_env(), start_new_session=True
    )
    log_file.close()
    server = Server(process=process, base_url=f"http://127.0.0.1:{port}", log_path=log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerStartError(
                f"sglang server exited with code {process.returncode} during start-up; log {log_path}:\n{server.log_tail()}"
            )
        try:
            status, _ = server.get("/health", timeout=2.0)
            if status == 200:
                return server
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.5)
    server.stop()
    raise ServerStartError(f"sglang server not healthy after {timeout_s:.0f}s; log {log_path}:\n{server.log_tail()}")
