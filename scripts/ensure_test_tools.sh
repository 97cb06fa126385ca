#!/usr/bin/env bash
# System programs the test suite runs for real, installed when missing (a prerequisite of
# `make test`, so CI's `.ci/run` gets them too):
#
#   program     Debian package   the tests that run it (skipped without it)
#   prometheus  prometheus       tests/metrics/test_prometheus.py: every dashboard query
#                                against a live Prometheus scraping two servers
#   promtool    prometheus       tests/metrics/test_registry.py::test_promtool_finds_nothing_to_say_about_the_full_exposition
#   shellcheck  shellcheck       tests/test_gpu_scripts.py::test_validate_script_is_shellcheck_clean
#
# The tests are run with the Debian bookworm versions (prometheus 2.42, shellcheck 0.9).
# Installs with apt-get when a program is missing and apt-get can run (as root, or through
# password-less sudo). Never fails the run: where it cannot install, it says so and names
# the tests that will be skipped (pytest -ra lists them with the reason).
set -uo pipefail

PROGRAMS=(prometheus promtool shellcheck)
declare -A PACKAGE=([prometheus]=prometheus [promtool]=prometheus [shellcheck]=shellcheck)
declare -A TESTS=(
  [prometheus]="tests/metrics/test_prometheus.py (the real-Prometheus dashboard test)"
  [promtool]="tests/metrics/test_registry.py::test_promtool_finds_nothing_to_say_about_the_full_exposition"
  [shellcheck]="tests/test_gpu_scripts.py::test_validate_script_is_shellcheck_clean"
)

missing() {
  local program
  for program in "${PROGRAMS[@]}"; do
    command -v "${program}" >/dev/null 2>&1 || echo "${program}"
  done
}

wanted=($(missing))
[ "${#wanted[@]}" -eq 0 ] && exit 0

skipping() {
  local program
  echo "ensure_test_tools: $*" >&2
  for program in $(missing); do
    echo "ensure_test_tools: no ${program}: ${TESTS[${program}]} will be SKIPPED" >&2
  done
  exit 0
}

packages=()
for program in "${wanted[@]}"; do
  case " ${packages[*]} " in
    *" ${PACKAGE[${program}]} "*) ;;
    *) packages+=("${PACKAGE[${program}]}") ;;
  esac
done

command -v apt-get >/dev/null 2>&1 || skipping "${wanted[*]} not on PATH and apt-get is not available to install ${packages[*]}"
as_root=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then
    as_root=(sudo -n)
  else
    skipping "${wanted[*]} not on PATH and installing them needs root (as root: apt-get install ${packages[*]})"
  fi
fi

echo "ensure_test_tools: ${wanted[*]} not on PATH: installing the Debian packages (apt-get install ${packages[*]})"
log="$(mktemp)"
export DEBIAN_FRONTEND=noninteractive
install_packages() {
  "${as_root[@]}" apt-get install -y -q --no-install-recommends "${packages[@]}" >>"${log}" 2>&1
}
if ! install_packages; then
  echo "ensure_test_tools: first try failed; refreshing the package lists (apt-get update)"
  if ! { "${as_root[@]}" apt-get update -q >>"${log}" 2>&1 && install_packages; }; then
    tail -n 20 "${log}" >&2
    rm -f "${log}"
    skipping "apt-get install ${packages[*]} failed (its last lines above)"
  fi
fi
rm -f "${log}"
for program in "${wanted[@]}"; do
  if command -v "${program}" >/dev/null 2>&1; then
    echo "ensure_test_tools: installed ${program}: $("${program}" --version 2>&1 | head -n 1)"
  fi
done
# The prometheus package enables a system service (port 9090) where systemd runs; the
# tests start their own Prometheus on a free port and need no service.
if [[ " ${packages[*]} " == *" prometheus "* ]] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
  if "${as_root[@]}" systemctl disable --now prometheus.service >/dev/null 2>&1; then
    echo "ensure_test_tools: stopped and disabled the prometheus.service the package enabled (the tests run their own)"
  fi
fi
[ -z "$(missing)" ] || skipping "the packages installed, but not every program is on PATH"
exit 0
