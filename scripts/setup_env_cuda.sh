#!/usr/bin/env bash
# `scripts/setup_env.sh --cuda` (or `make gpu-env`): create or update .venv-cuda, harvest's
# environment on a GPU server: SGLang 0.5.23 with everything it pins (torch 2.14.1, the
# PyPI CUDA 13.0 build; transformers 5.19.0; sglang-kernel; flashinfer; ...), LlamaFactory
# 0.9.5 installed the way the CPU stack installs it (--no-deps, its runtime needs from
# requirements/cuda.txt), and harvest itself, editable, with its native libraries built
# against the CUDA headers of the torch it runs with. requirements/lock-cuda.txt pins every
# version (made and checked by scripts/check_cuda_resolution.py; docs/gpu-validation.md).
#
# A separate venv from the CPU one (.venv, `make test`): a CPU stack and a CUDA stack never
# replace each other. Idempotent: a stamp records the hash of what decides the
# environment, and a run with nothing changed does nothing.
#
# Needs: Linux x86-64, glibc >= 2.34 (sglang 0.5.23 ships manylinux_2_34 wheels only),
# Python 3.11 or 3.12, a C++ compiler, and an NVIDIA driver >= 580 (CUDA 13.0, what torch
# 2.14.1 is built for; green contexts need 12.4+, so that is covered). No CUDA toolkit:
# the headers come from the nvidia-cuda-runtime wheel torch brings, and no nvcc is needed
# (harvest's one kernel ships as PTX text and is JIT-compiled by the driver; SGLang's JIT
# kernels use the nvcc of the nvidia-cuda-nvcc wheel). Settings (environment):
#   HARVEST_PYTHON          the interpreter (default: python3.12, else python3.11)
#   HARVEST_CUDA_VENV       the venv folder (default: .venv-cuda in the checkout)
#   HARVEST_CUDA_HEADERS    a folder with cuda.h + cudaTypedefs.h to build against instead
#   HARVEST_CUDA_NO_DRIVER=1  build without a driver (e.g. a container image build on a
#                           host without GPU): skips the driver check and the GPU checks
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HARVEST_CUDA_VENV:-${ROOT}/.venv-cuda}"
NO_DRIVER="${HARVEST_CUDA_NO_DRIVER:-0}"
MIN_DRIVER=580
cd "${ROOT}"

die() { echo "setup_env --cuda: $*" >&2; exit 1; }

for arg in "$@"; do
  case "${arg}" in
    --no-driver) NO_DRIVER=1 ;;
    *) die "unknown argument ${arg} (usage: scripts/setup_env.sh --cuda [--no-driver])" ;;
  esac
done

# --- what the machine must have: checked before anything is touched ---
{ [ "$(uname -s)" = Linux ] && [ "$(uname -m)" = x86_64 ]; } \
  || die "the CUDA stack is pinned for Linux x86-64 only (this is $(uname -s) $(uname -m))"
glibc="$(getconf GNU_LIBC_VERSION 2>/dev/null || true)"
glibc="${glibc##* }"
glibc_major="${glibc%%.*}"
glibc_minor="${glibc#*.}"
glibc_minor="${glibc_minor%%.*}"
if ! [[ "${glibc_major}" =~ ^[0-9]+$ && "${glibc_minor}" =~ ^[0-9]+$ ]] \
   || [ "${glibc_major}" -lt 2 ] || { [ "${glibc_major}" -eq 2 ] && [ "${glibc_minor}" -lt 34 ]; }; then
  die "glibc ${glibc:-unknown} is too old: sglang 0.5.23 ships manylinux_2_34 wheels only (needs glibc >= 2.34, e.g. Ubuntu 22.04+)"
fi

python_minor() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }
if [ -n "${HARVEST_PYTHON:-}" ]; then
  PY="${HARVEST_PYTHON}"
  case "$(python_minor "${PY}")" in
    3.11|3.12) ;;
    *) die "HARVEST_PYTHON=${PY} is not a working Python 3.11 or 3.12 (the versions the CUDA stack is resolved for)" ;;
  esac
else
  PY=""
  for candidate in python3.12 python3.11; do
    if command -v "${candidate}" >/dev/null 2>&1 && [ "$(python_minor "${candidate}")" = "${candidate#python}" ]; then
      PY="${candidate}"; break
    fi
  done
  [ -n "${PY}" ] || die "neither python3.12 nor python3.11 found: the CUDA stack needs one of them (or set HARVEST_PYTHON)"
fi
"${PY}" -c 'import venv' 2>/dev/null || die "${PY} has no venv module (Debian: apt-get install python3-venv)"

command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 \
  || die "no C++ compiler (c++/g++) on PATH: install gcc/g++ (Debian: apt-get install g++)"

if [ "${NO_DRIVER}" != 1 ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    smi="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1)" \
      || die "nvidia-smi failed: ${smi} (is the NVIDIA driver loaded? set HARVEST_CUDA_NO_DRIVER=1 to build without one)"
    driver="$(echo "${smi}" | head -n1 | tr -d ' ')"
    [[ "${driver%%.*}" =~ ^[0-9]+$ ]] || die "cannot read the driver version from nvidia-smi: ${smi}"
    [ "${driver%%.*}" -ge "${MIN_DRIVER}" ] \
      || die "NVIDIA driver ${driver} is too old: torch 2.14.1 (sglang 0.5.23's pin) is the CUDA 13.0 build and needs driver >= ${MIN_DRIVER}"
  elif grep -q 'libcuda\.so\.1' <<<"$(ldconfig -p 2>/dev/null || true)"; then
    driver="unknown (no nvidia-smi; libcuda.so.1 present: checked after the install)"
  else
    die "no NVIDIA driver: neither nvidia-smi nor libcuda.so.1 found. Install the NVIDIA driver (>= ${MIN_DRIVER}, CUDA 13.0), or set HARVEST_CUDA_NO_DRIVER=1 to build the environment without one (e.g. a container image built on a host without GPU)"
  fi
  echo "setup_env --cuda: NVIDIA driver ${driver}"
fi
if [ -n "${HARVEST_CUDA_HEADERS:-}" ]; then
  { [ -f "${HARVEST_CUDA_HEADERS}/cuda.h" ] && [ -f "${HARVEST_CUDA_HEADERS}/cudaTypedefs.h" ]; } \
    || die "HARVEST_CUDA_HEADERS=${HARVEST_CUDA_HEADERS} has no cuda.h and cudaTypedefs.h"
fi

# --- up to date? ---
stamp_inputs() {
  cat requirements/cuda.txt requirements/lock-cuda.txt pyproject.toml CMakeLists.txt scripts/setup_env.sh scripts/setup_env_cuda.sh
  find csrc -type f \( -name '*.cpp' -o -name '*.h' -o -name 'CMakeLists.txt' \) | LC_ALL=C sort | xargs cat
  echo "python=$(python_minor "${PY}") headers=${HARVEST_CUDA_HEADERS:-wheel} no_driver=${NO_DRIVER}"
}
want="$(stamp_inputs | sha256sum | cut -d' ' -f1)"
stamp="${VENV}/.harvest-stamp"
if [ -f "${stamp}" ] && [ "$(cat "${stamp}")" = "${want}" ] && [ -x "${VENV}/bin/harvest" ]; then
  exit 0
fi

echo "setup_env --cuda: preparing ${VENV} with ${PY} (first run downloads several GB: torch, CUDA libraries, SGLang kernels)"
if [ -x "${VENV}/bin/python" ] && [ "$(python_minor "${VENV}/bin/python")" != "$(python_minor "${PY}")" ]; then
  die "${VENV} was made with Python $(python_minor "${VENV}/bin/python"), not $(python_minor "${PY}"): remove it or set HARVEST_PYTHON to match"
fi
[ -x "${VENV}/bin/python" ] || "${PY}" -m venv "${VENV}"
PIP=("${VENV}/bin/python" -m pip --disable-pip-version-check)
pip_install() {
  local log
  log="$(mktemp)"
  if ! "${PIP[@]}" install "$@" >"${log}" 2>&1; then
    cat "${log}" >&2
    rm -f "${log}"
    die "pip install $* failed (output above)"
  fi
  rm -f "${log}"
}
# 1. SGLang with its whole dependency tree, LlamaFactory's runtime needs, harvest's own and
#    the build/test tools, every version from the lock.
pip_install -r requirements/cuda.txt -c requirements/lock-cuda.txt
# 2. LlamaFactory without its declared dependencies (its transformers<=5.6.0 cap cannot sit
#    beside sglang's transformers==5.19.0; harvest sets DISABLE_VERSION_CHECK=1).
pip_install --no-deps -c requirements/lock-cuda.txt "llamafactory==0.9.5"
site="$("${VENV}/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# The CPU stand-ins (tests/cpu_stubs) must never shadow the real CUDA packages here.
rm -f "${site}/harvest_cpu_stubs.pth"
# 3. harvest, editable, its native libraries built against the headers of the CUDA version
#    torch was built for (the nvidia-cuda-runtime wheel), in a build folder of their own.
if [ -n "${HARVEST_CUDA_HEADERS:-}" ]; then
  headers="${HARVEST_CUDA_HEADERS}"
else
  cuda_major="$("${VENV}/bin/python" -c 'import torch; print((torch.version.cuda or "").split(".")[0])')"
  [ -n "${cuda_major}" ] || die "the installed torch is not a CUDA build (torch.version.cuda is None)"
  headers="${site}/nvidia/cu${cuda_major}/include"
  { [ -f "${headers}/cuda.h" ] && [ -f "${headers}/cudaTypedefs.h" ]; } \
    || die "no CUDA headers at ${headers} (the nvidia-cuda-runtime wheel should carry them): set HARVEST_CUDA_HEADERS to a CUDA ${cuda_major} toolkit's include folder"
fi
pip_install --no-build-isolation --no-deps \
  --config-settings=build-dir="build/cuda-{wheel_tag}" \
  --config-settings=cmake.define.HARVEST_CUDA_HEADERS="${headers}" \
  -e .

# 4. What was built is what a GPU needs: the pinned CUDA torch, the packages importable,
#    the native libraries loaded; with a driver, the GPU seen by torch and by harvest's
#    own driver probe (VMM required, green contexts reported).
HARVEST_SETUP_NO_DRIVER="${NO_DRIVER}" DISABLE_VERSION_CHECK=1 "${VENV}/bin/python" - <<'EOF' || die "the environment was built but does not check out (above)"
import importlib.metadata as md
import os
import sys

problems = []
import torch

if torch.__version__.split("+")[0] != "2.14.1" or not (torch.version.cuda or "").startswith("13."):
    problems.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}): expected 2.14.1 built for CUDA 13")
for dist, want in (("sglang", "0.5.23"), ("transformers", "5.19.0"), ("llamafactory", "0.9.5")):
    if md.version(dist) != want:
        problems.append(f"{dist} {md.version(dist)}: expected {want}")
import llamafactory  # noqa: F401,E402
import peft  # noqa: F401,E402
import sglang  # noqa: F401,E402

from harvest import doctor  # noqa: E402

report = doctor.collect()
for name, lib in report["native_libraries"].items():
    if not lib.get("path"):
        problems.append(f"native library {name}: {lib.get('error')}")
if os.environ["HARVEST_SETUP_NO_DRIVER"] != "1":
    if not torch.cuda.is_available():
        problems.append("torch.cuda.is_available() is False: the driver does not serve this torch build")
    if not report["gpu_present"]:
        problems.append(f"harvest's driver probe sees no GPU: {report['no_gpu_reason']}")
    for gpu in report["gpus"]:
        if not gpu["vmm_supported"]:
            problems.append(f"GPU {gpu['ordinal']} ({gpu['name']}) has no CUDA VMM support: harvest's allocator needs it")
print(doctor.render_text(report))
if report["gpus"] and not report["gpus"][0]["green_contexts_supported"]:
    print("setup_env --cuda: note: no green contexts (driver < 12.4?): harvest will run one SM level")
for problem in problems:
    print(f"setup_env --cuda: {problem}", file=sys.stderr)
sys.exit(1 if problems else 0)
EOF
echo "${want}" > "${stamp}"
echo "setup_env --cuda: ${VENV} ready (${VENV}/bin/harvest doctor; ${VENV}/bin/python -m pytest -m gpu tests)"
