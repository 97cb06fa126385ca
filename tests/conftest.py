"""Shared fixtures: tiny models built once per run, GPU detection, SGLang env.

Tests marked ``gpu`` run only where a CUDA driver and GPU are present (through the same
probe `harvest doctor` uses); elsewhere they are skipped with the reason.
"""

from __future__ import annotations

import functools
import os
import signal

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DISABLE_VERSION_CHECK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Tests interrupt the commands they start (SIGINT, as Ctrl-C does) and check that what
# was measured is kept. A suite started in the background by a non-interactive shell
# (`make test &`, CI runners) inherits SIGINT *ignored*, every child then ignores it too
# and Python installs no KeyboardInterrupt handler: the interrupted command ran to its
# end. A caught signal is reset to the default on exec, so catching it here gives every
# child (and every xdist worker, which imports this file too) the terminal's behaviour.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@functools.lru_cache(maxsize=1)
def gpu_unavailable_reason() -> str | None:
    from harvest.compute import device

    gpus, reason, _ = device.probe_gpus()
    return None if gpus else reason


# `make test` runs the suite on two pytest-xdist workers (--dist loadgroup). Every test that
# starts SGLang servers (marked sglang) goes to one lane, one such test at a time: two
# servers starting at once on a 2-core machine each take twice as long, and their trainers
# and decode steps fight for the same cores. The other worker runs everything else, with
# the sglang tests marked no_server (SGLang's launcher refuses before any process starts).
SGLANG_LANE = "sglang-servers"


def _join_lane(item, lane: str, loadgroup: bool) -> None:
    item.add_marker(pytest.mark.xdist_group(lane))
    if not loadgroup:
        return
    # xdist 3.8 tells its scheduler an item's group by appending "@group" to the item's
    # node id through `item._nodeid`, which pytest 9.2 no longer reads (its ids are
    # structured: `item._id`): the group was silently dropped (pytest-xdist issue 1386).
    # Until a fixed xdist ships, the id is written here the way xdist means it to be;
    # tests/test_test_lanes.py fails if the lane stops forming.
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # a pytest before 9.2: xdist's own `_nodeid` works there
        return
    if isinstance(getattr(item, "_id", None), NodeId) and not item.nodeid.endswith("@" + lane):
        item._id = NodeId.parse(f"{item.nodeid}@{lane}")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    loadgroup = bool(getattr(config.option, "loadgroup", False))  # set on xdist's workers only
    for item in items:
        if "sglang" in item.keywords and "no_server" not in item.keywords:
            _join_lane(item, SGLANG_LANE, loadgroup)
    reason = gpu_unavailable_reason() if any("gpu" in item.keywords for item in items) else None
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"needs an NVIDIA GPU: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def full_trace():
    """The full one-hour Azure conversation trace, which the repository does not ship:
    the path in HARVEST_FULL_TRACE (the downloaded AzureLLMInferenceTrace_conv.csv of
    github.com/Azure/AzurePublicDataset); the test is skipped when it is not set."""
    from pathlib import Path

    value = os.environ.get("HARVEST_FULL_TRACE")
    if not value:
        pytest.skip("HARVEST_FULL_TRACE is not set (the path of the full Azure trace, "
                    "data/AzureLLMInferenceTrace_conv.csv of github.com/Azure/AzurePublicDataset)")
    path = Path(value)
    if not path.is_file():
        pytest.fail(f"HARVEST_FULL_TRACE={value}: no such file")
    return path


@pytest.fixture(scope="session")
def tiny_llama_path():
    from harvest.tiny_model import TINY_LLAMA, ensure_tiny_model

    return ensure_tiny_model(TINY_LLAMA)


@pytest.fixture(scope="session")
def tiny_qwen2_path():
    from harvest.tiny_model import TINY_QWEN2, ensure_tiny_model

    return ensure_tiny_model(TINY_QWEN2)


@pytest.fixture(autouse=True)
def _environment_restored():
    """Every test leaves os.environ as it found it. harvest writes variables a server's
    processes inherit (HARVEST_ENABLED, CUDA_DEVICE_MAX_CONNECTIONS, ... from the
    plugin's launcher hook and the CLI); one leaked from an in-process test reached every
    server started after it (monkeypatch.delenv of an unset name restores nothing)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def plain_server_outputs(tiny_llama_path, tmp_path_factory):
    """Greedy outputs of one SGLang server without harvest (the CPU flags, no radix cache,
    16384 KV tokens), the reference of every test that compares a harvest server's answers
    with it: {"colocation": tests/colocate/test_sglang_colocation.py's light requests (8 at
    a time) and burst (all at once), "fleet": tests/fleet/test_sglang_fleet.py's prompts (4
    at a time)}. Both modules asked for the same server: one start serves both, each set
    sent as its module sent it, one after the other (no radix cache: nothing carries over)."""
    import concurrent.futures

    from harvest.sglang import server
    from tests.colocate import test_sglang_colocation as colocation
    from tests.fleet import test_sglang_fleet as fleet

    log = tmp_path_factory.mktemp("plain-reference") / "sglang.log"
    light, burst = colocation._prompts()
    with server.launch(colocation._args(tiny_llama_path), log_path=log) as srv:
        outputs = {"colocation": (colocation._generate_all(srv, light, 8), colocation._generate_all(srv, burst, colocation.BURST))}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            outputs["fleet"] = list(pool.map(lambda ids: fleet._generate(srv, ids), fleet._prompts()))
    assert colocation.RETRACTION not in log.read_text(errors="replace")  # the pool fits the burst without harvest
    return outputs
