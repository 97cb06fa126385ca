"""scripts/ensure_test_tools.sh (a prerequisite of `make test`): installs the programs some
tests run for real (prometheus, promtool, shellcheck) with apt-get when they are missing,
and never fails the run where it cannot, naming the tests that will be skipped. Run
against stand-in programs on a PATH of its own: nothing is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ensure_test_tools.sh"
BASICS = ["bash", "mktemp", "tail", "head", "rm", "chmod"]
PRESENT = "#!/bin/sh\necho \"$(basename $0), version 1\"\n"
ALL = {"prometheus": PRESENT, "promtool": PRESENT, "shellcheck": PRESENT}


def _bin(tmp_path: Path, programs: dict[str, str], uid: int = 0) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in BASICS:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    for name, body in {"id": f"#!/bin/sh\necho {uid}\n", "basename": "#!/bin/sh\necho ${1##*/}\n", **programs}.items():
        path = bin_dir / name
        path.write_text(body)
        path.chmod(0o755)
    return bin_dir


def _run(bin_dir: Path) -> subprocess.CompletedProcess:
    env = {"PATH": str(bin_dir), "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run([shutil.which("bash"), str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)


def test_nothing_to_do_when_every_program_is_there(tmp_path):
    out = _run(_bin(tmp_path, ALL))
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")


def test_without_apt_get_it_names_the_tests_that_will_be_skipped(tmp_path):
    out = _run(_bin(tmp_path, {"shellcheck": PRESENT}))
    assert out.returncode == 0
    assert "prometheus promtool not on PATH and apt-get is not available to install prometheus" in out.stderr
    assert "no prometheus: tests/metrics/test_prometheus.py (the real-Prometheus dashboard test) will be SKIPPED" in out.stderr
    assert "no promtool: tests/metrics/test_registry.py::" in out.stderr and "shellcheck" not in out.stderr


def test_without_root_it_names_the_tests_that_will_be_skipped(tmp_path):
    out = _run(_bin(tmp_path, {"apt-get": "#!/bin/sh\nexit 1\n"}, uid=1000))
    assert out.returncode == 0 and "needs root (as root: apt-get install prometheus shellcheck)" in out.stderr
    assert out.stderr.count("will be SKIPPED") == 3


def test_installs_with_apt_get_refreshing_the_lists_when_the_first_try_fails(tmp_path):
    bin_dir = tmp_path / "bin"
    calls = tmp_path / "calls"
    # Fails until `apt-get update` ran (stale lists), then "installs" the programs.
    apt_get = f"""#!/bin/sh
echo "$*" >> {calls}
case "$1" in
  update) echo updated > {tmp_path}/updated ;;
  install) [ -f {tmp_path}/updated ] || exit 100
           for p in prometheus promtool shellcheck; do
             printf '#!/bin/sh\\necho "%s, version 9"\\n' $p > {bin_dir}/$p; chmod 755 {bin_dir}/$p
           done ;;
esac
"""
    out = _run(_bin(tmp_path, {"apt-get": apt_get}))
    assert out.returncode == 0, out.stderr
    install = "install -y -q --no-install-recommends prometheus shellcheck"
    assert calls.read_text().splitlines() == [install, "update -q", install]
    assert "installing the Debian packages (apt-get install prometheus shellcheck)" in out.stdout
    assert "installed prometheus: prometheus, version 9" in out.stdout and "installed shellcheck" in out.stdout
    assert out.stderr == ""


def test_a_failed_install_does_not_fail_the_run(tmp_path):
    apt_get = "#!/bin/sh\necho 'E: Unable to locate package prometheus' >&2\nexit 100\n"
    out = _run(_bin(tmp_path, {"apt-get": apt_get, "promtool": PRESENT}))
    assert out.returncode == 0
    assert "E: Unable to locate package prometheus" in out.stderr
    assert "apt-get install prometheus shellcheck failed" in out.stderr and out.stderr.count("will be SKIPPED") == 2
