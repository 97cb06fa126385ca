"""Fixtures for the trainer tests (helpers live in trainer_helpers.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _single_intra_op_thread():
    # The CI machine has 2 shared cores: two OpenMP threads fighting other processes
    # turn a 20 us matmul into milliseconds. Results are identical either way.
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def _compile_auto_as_on(monkeypatch, request):
    """HARVEST_TEST_COMPILE=on (``make test-compiled``): every trainer these tests build with
    ``trainer.compile: auto``, which on a CPU does not compile, compiles its decoder layers,
    so the trainer suite that runs eager in ``make test`` runs compiled too. Not in
    test_compiled_units.py, whose tests choose, and test what auto means, themselves."""
    import os

    if os.environ.get("HARVEST_TEST_COMPILE") != "on" or request.module.__name__.endswith(".test_compiled_units"):
        return
    from harvest.train import compiled_units

    wants = compiled_units.wants_compile
    monkeypatch.setattr(compiled_units, "wants_compile",
                        lambda requested, device: True if requested == "auto" else wants(requested, device))
