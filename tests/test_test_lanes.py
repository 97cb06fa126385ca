"""`make test`'s lanes: on two xdist workers with --dist loadgroup, every sglang test runs on
one worker, one after another, and the other tests go beside them (tests/conftest.py). A
lane that stops forming (an xdist or pytest upgrade) fails here instead of quietly putting
two SGLang servers on the same two cores."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("xdist")

SUITE = '''
import os, time
from pathlib import Path

import pytest

def _record(name):
    Path(os.environ["LANES_OUT"], name).write_text(os.environ.get("PYTEST_XDIST_WORKER", "none"))

@pytest.mark.sglang
@pytest.mark.parametrize("i", range(4))
def test_server(i):
    time.sleep(0.3)
    _record(f"server-{i}")

@pytest.mark.parametrize("i", range(6))
def test_other(i):
    time.sleep(0.05)
    _record(f"other-{i}")

@pytest.mark.sglang
@pytest.mark.no_server
def test_launcher_refusal(request):
    Path(os.environ["LANES_OUT"], "launcher-nodeid").write_text(request.node.nodeid)
'''


def test_sglang_tests_share_one_worker_and_the_rest_run_beside_them(tmp_path):
    suite, out = tmp_path / "suite", tmp_path / "out"
    suite.mkdir(), out.mkdir()
    (suite / "test_lanes_example.py").write_text(SUITE)
    # The suite's own hook, as tests/conftest.py defines it (not its fixtures).
    (suite / "conftest.py").write_text(textwrap.dedent("""
        from tests.conftest import pytest_collection_modifyitems  # noqa: F401
    """))
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    sglang: starts SGLang\n    no_server: none starts\n")
    env = {**os.environ, "LANES_OUT": str(out), "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", str(suite)],
                            cwd=suite, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # An sglang test that starts no server is not in the lane (it may run on either worker).
    assert "@" not in (out / "launcher-nodeid").read_text()
    (out / "launcher-nodeid").unlink()
    workers = {path.name: path.read_text() for path in out.iterdir()}
    servers = {workers[f"server-{i}"] for i in range(4)}
    others = {workers[f"other-{i}"] for i in range(6)}
    assert len(servers) == 1 and servers <= {"gw0", "gw1"}, workers
    assert others - servers, workers  # the other worker ran tests beside the lane
