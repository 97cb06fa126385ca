#!/usr/bin/env bash
# Create or update .venv: the pinned CPU stack (torch 2.13.0 CPU build, sglang 0.5.23,
# llamafactory 0.9.5, ...) and harvest itself in editable mode, with its native
# libraries built by scikit-build-core + CMake.
#
# Idempotent and fast when up to date: a stamp records the hash of everything that
# decides the environment (requirements, lock, pyproject, the native sources); if it
# matches, nothing runs. Change any of them and the next run installs what changed.
#
# Why it is not a plain `pip install -e .[serve,train]`:
#  * sglang 0.5.23 pins torch==2.14.1 and llamafactory wants transformers<=5.6.0. Both are
#    installed with --no-deps and their runtime needs come from requirements/cpu.txt,
#    pinned by requirements/lock-cpu.txt (torch==2.13.0: never let pip pull a CUDA torch).
#  * the PyPI torchvision/torchaudio wheels are CUDA builds that break at import on CPU;
#    torchvision is installed --no-deps, torchaudio not at all; tests/cpu_stubs/ (put on
#    sys.path by a .pth file) carries the import hook and
#    stand-ins SGLang and LlamaFactory need on CPU: see tests/cpu_stubs/README.md.
#
# `scripts/setup_env.sh --cuda` builds the CUDA stack for a GPU server instead, in its own
# venv (.venv-cuda): scripts/setup_env_cuda.sh says how. Without --cuda nothing of it runs.
set -euo pipefail

if [ "${1:-}" = "--cuda" ]; then
  shift
  exec bash "$(dirname "${BASH_SOURCE[0]}")/setup_env_cuda.sh" "$@"
fi
if [ "$#" -gt 0 ]; then
  echo "setup_env: unknown argument $1 (usage: scripts/setup_env.sh [--cuda])" >&2
  exit 2
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ROOT}/.venv"
PY="${HARVEST_PYTHON:-python3.11}"
cd "${ROOT}"

die() { echo "setup_env: $*" >&2; exit 1; }

command -v "${PY}" >/dev/null 2>&1 || die "${PY} not found: harvest's CPU environment needs Python 3.11 (set HARVEST_PYTHON to another 3.11 interpreter)"
command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || die "no C++ compiler (c++/g++) on PATH: install gcc/g++ (Debian: apt-get install g++)"
command -v cmake >/dev/null 2>&1 || die "cmake not found on PATH: install cmake >= 3.22 (Debian: apt-get install cmake)"
command -v make >/dev/null 2>&1 || die "make not found on PATH (Debian: apt-get install make)"
if [ ! -f /usr/local/cuda/include/cudaTypedefs.h ] && [ -z "${CUDA_HOME:-}" ]; then
  die "CUDA headers not found (/usr/local/cuda/include/cudaTypedefs.h): install the CUDA toolkit headers or set CUDA_HOME; no GPU or driver is needed"
fi

stamp_inputs() {
  cat requirements/cpu.txt requirements/lock-cpu.txt requirements/constraints-cpu.txt pyproject.toml CMakeLists.txt scripts/setup_env.sh
  find csrc tests/cpu_stubs -type f \( -name '*.cpp' -o -name '*.h' -o -name 'CMakeLists.txt' -o -name '*.py' \) | LC_ALL=C sort | xargs cat
}
want="$(stamp_inputs | sha256sum | cut -d' ' -f1)"
stamp="${VENV}/.harvest-stamp"
if [ -f "${stamp}" ] && [ "$(cat "${stamp}")" = "${want}" ] && [ -x "${VENV}/bin/harvest" ]; then
  exit 0
fi

echo "setup_env: preparing ${VENV} (first run takes about 2 minutes)"
[ -x "${VENV}/bin/python" ] || "${PY}" -m venv "${VENV}"
PIP=("${VENV}/bin/python" -m pip --disable-pip-version-check)
# pip's output only when it fails: quiet when all goes well, the whole story when not.
pip_install() {
  local log
  log="$(mktemp)"
  if ! "${PIP[@]}" install "$@" >"${log}" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "${log}" >&2 || true
    rm -f "${log}"
    die "pip install $* failed (output above)"
  fi
  rm -f "${log}"
}
# The CPU torch first, from the wheel on disk when there is one (pip's find-links).
pip_install "torch==2.13.0"
pip_install --no-deps "sglang==0.5.23" "llamafactory==0.9.5" "torchvision==0.28.0"
pip_install -r requirements/cpu.txt -c requirements/lock-cpu.txt
# Stand-ins for CUDA-only pieces, on sys.path of every process of this venv (SGLang's
# scheduler subprocesses included) through a .pth file.
site="$("${VENV}/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
printf '%s\nimport harvest_cpu_import_hooks; harvest_cpu_import_hooks.install()\n' "${ROOT}/tests/cpu_stubs" >"${site}/harvest_cpu_stubs.pth"
# harvest itself, editable; the native libraries build in build/ (incremental).
pip_install --no-build-isolation --no-deps -e .
"${VENV}/bin/python" -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') and not torch.version.cuda else f'setup_env: wrong torch {v} (cuda={torch.version.cuda}): the CPU 2.13.0 build was replaced')"
echo "${want}" > "${stamp}"
echo "setup_env: ${VENV} ready"
