"""Start, probe and stop an SGLang HTTP server in a subprocess (demo, tests, benchmarks).

The server runs in its own process group so that stopping it also ends the scheduler
and detokenizer processes SGLang forks; its output goes to a log file whose tail is
quoted when start-up fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def cpu_server_args(model_path: str | Path, *, decode_instance: bool = False, max_total_tokens: int = 16384) -> list[str]:
    """SGLang flags that serve ``model_path`` on CPU (see ../shared/notes/sglang-on-cpu.md)."""
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
    return env


def free_port() -> int:
    with socket.socket() as sock:
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
