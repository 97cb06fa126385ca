"""Server.processes finds a launched server's own processes by its session: not another
server's running the same module on this machine, and still after their parent is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from harvest.sglang import server

MODULE = "http.server"  # any module that runs until it is ended
CHILD = [sys.executable, "-m", MODULE, "0", "--bind", "127.0.0.1"]


def test_a_servers_processes_are_its_sessions_not_the_machines(tmp_path):
    foreign = subprocess.Popen(CHILD, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # another suite's
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         f"child = subprocess.Popen({CHILD!r}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
         "print(child.pid, flush=True)\ntime.sleep(600)"],
        stdout=subprocess.PIPE, start_new_session=True)  # as server.launch starts SGLang
    try:
        child = int(launcher.stdout.readline())
        srv = server.Server(process=launcher, base_url="http://127.0.0.1:1", log_path=tmp_path / "log")
        assert srv.processes(MODULE) == {child}
        launcher.kill()  # the parent goes; its child stays in the session
        launcher.wait()
        assert srv.processes(MODULE) == {child}
        os.killpg(launcher.pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while srv.processes(MODULE) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.processes(MODULE) == set()
        assert foreign.poll() is None  # not touched, never listed
    finally:
        foreign.terminate()
        foreign.wait()
        try:
            os.killpg(launcher.pid, signal.SIGKILL)  # whatever of the session is left
        except ProcessLookupError:
            pass
        launcher.wait()


CHILD_SIGINT = """
import signal, subprocess, sys
probe = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
def child():
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()
before = child()
import tests.conftest  # what every test process imports first
print(before, child())
"""


def test_the_commands_tests_start_can_be_interrupted_however_the_suite_was_started():
    """tests/conftest.py: a suite started in the background inherits SIGINT ignored; the
    commands it starts must still turn SIGINT into KeyboardInterrupt (tests interrupt
    `harvest profile` and the GPU scripts and check what they kept)."""
    import subprocess
    import sys

    # `&` in a non-interactive shell: the background job starts with SIGINT ignored.
    result = subprocess.run(["bash", "-c", f"{sys.executable} -c '{CHILD_SIGINT}' & wait"], capture_output=True,
                            text=True, timeout=120)
    assert result.stdout.split() == ["False", "True"], result
