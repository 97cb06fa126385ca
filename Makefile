# The two entry points a newcomer needs: `make demo` and `make test`. Both set up .venv
# first (scripts/setup_env.sh: idempotent, a no-op when up to date).
SHELL := /bin/bash
VENV := .venv
PYTHON := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export DISABLE_VERSION_CHECK := 1
export TOKENIZERS_PARALLELISM := false
# CI sets CI; so does every run of the suite here, so a local run checks what CI checks
# (torch's inductor, for one, turns some of its warnings into errors when CI is set).
export CI := true

.PHONY: venv test-tools demo test test-fast test-compiled test-gpu gpu-env native clean help

help:
	@echo "make demo   - set up .venv if needed, then run harvest's CPU demo"
	@echo "make test   - set up .venv (and prometheus, shellcheck: apt-get) if needed, then run the whole test suite"
	@echo "make gpu-env - on a GPU server: build .venv-cuda (SGLang 0.5.23 on CUDA; README, Running on a GPU)"

venv:
	@bash scripts/setup_env.sh

demo: venv
	$(VENV)/bin/harvest demo

# System programs some tests run for real (prometheus, promtool, shellcheck), installed with
# apt-get when missing and possible; otherwise it names the tests that will be skipped and
# the run goes on (docs/testing.md).
test-tools:
	@bash scripts/ensure_test_tools.sh

# Two pytest-xdist workers: one runs the SGLang server tests one after another (their lane,
# tests/conftest.py), the other everything else beside it. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
PYTEST_WORKERS = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

test: venv test-tools
	$(PYTHON) -m pytest -q -ra $(PYTEST_WORKERS) tests

# Policy and mechanism tests only (no SGLang server start-ups): seconds, for iteration.
test-fast: venv
	$(PYTHON) -m pytest -q -ra $(PYTEST_WORKERS) -m "not sglang and not slow" tests

# The trainer tests again with every trainer's decoder layers compiled (trainer.compile
# auto means off on a CPU; tests/train/conftest.py turns it on): tens of minutes.
test-compiled: venv
	HARVEST_TEST_COMPILE=on $(PYTHON) -m pytest -q -ra tests/train

# On a GPU server: the GPU tests from the CUDA stack (.venv-cuda, built first if needed).
test-gpu: gpu-env
	.venv-cuda/bin/python -m pytest -q -ra -m gpu tests

# On a GPU server: the CUDA stack in .venv-cuda (scripts/setup_env_cuda.sh). Not a
# prerequisite of anything above: the CPU targets keep using .venv.
gpu-env:
	@bash scripts/setup_env.sh --cuda

native: venv
	$(PYTHON) -m pip install --no-build-isolation --no-deps -q -e .

clean:
	rm -rf build .cache/tiny-models .pytest_cache
