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
