"""What ``trainer.compile`` trusts (issue 35, bad input): a cache whose artifacts do not
load is set aside and the layer compiles again (never runs what the cache holds, never
falls back to eager for the cache's fault); another torch's artifacts are kept apart and
named in a warning; a layer whose backward cannot compile runs eager from its first
forward call (the backward compiles there), with the reason, and the step is eager's."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn

from harvest.train import compiled_units

pytestmark = pytest.mark.timeout(600)


class _Block(nn.Module):
    """A decoder layer's kind of work, small: a projection, SiLU, a residual."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.nn.functional.silu(self.proj(x))


def _step(block, x, grad):
    leaf = x.detach().clone().requires_grad_(True)
    block.zero_grad(set_to_none=True)
    out = block(leaf)
    out.backward(grad)
    return [out.detach(), leaf.grad, block.proj.weight.grad]


@pytest.fixture
def fresh_compiler(monkeypatch, tmp_path):
    """Harvest's cache under tmp_path, nothing of dynamo's or inductor's state kept."""
    from torch._inductor.utils import clear_caches

    monkeypatch.setenv("HARVEST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(compiled_units, "_cache_set_aside", False)
    monkeypatch.setattr(compiled_units, "_warned_versions", set())
    torch._dynamo.reset()
    clear_caches()
    yield tmp_path / "cache" / "torchinductor" / torch.__version__
    torch._dynamo.reset()
    clear_caches()


def _compiled_block(seed=0):
    torch.manual_seed(seed)
    block = _Block()
    state = compiled_units.compile_layers([block], "on", torch.device("cpu"))
    return block, state


def test_artifacts_that_do_not_load_are_set_aside_and_compiled_again(fresh_compiler, caplog):
    from torch._inductor.utils import clear_caches

    x, grad = torch.randn(4, 16), torch.randn(4, 16)
    torch.manual_seed(0)
    expected = _step(_Block(), x, grad)
    block, state = _compiled_block()
    assert [torch.equal(a, b) for a, b in zip(_step(block, x, grad), expected)] == [True] * 3
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(fresh_compiler)
    modules = [p for p in fresh_compiler.rglob("*.py") if p.is_file()]
    assert modules, "the first compilation wrote no output code into harvest's cache"
    for path in modules:  # what a crash mid-write or a damaged disk leaves
        path.write_text("def call(args):\n    return (\n")

    torch._dynamo.reset()
    clear_caches()  # a new process: only the files remain
    block, state = _compiled_block()
    with caplog.at_level(logging.WARNING, logger="harvest"):
        out = _step(block, x, grad)
    assert [torch.equal(a, b) for a, b in zip(out, expected)] == [True] * 3
    status = state.status()
    assert (status["layers_compiled"], status["reason"]) == (1, None)  # compiled, not eager
    assert block._compiled_call_impl is not None
    aside = [p for p in fresh_compiler.parent.iterdir() if ".aside-" in p.name]
    assert len(aside) == 1 and fresh_compiler.is_dir()
    warnings = [r.getMessage() for r in caplog.records if "would not load" in r.getMessage()]
    assert len(warnings) == 1 and str(aside[0]) in warnings[0]
    # One readable line, with the cause: not the backend's 150 kB decomposition table.
    assert len(warnings[0]) < 2000 and "Failed to import" in warnings[0], len(warnings[0])


def test_another_torchs_artifacts_are_kept_apart_and_named(fresh_compiler, caplog):
    old = fresh_compiler.parent / "2.11.0"
    old.mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="harvest"):
        compiled_units.use_harvest_cache()
        compiled_units.use_harvest_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(fresh_compiler)
    warnings = [r.getMessage() for r in caplog.records if "2.11.0" in r.getMessage()]
    assert len(warnings) == 1 and f"not used by torch {torch.__version__}" in warnings[0]


def test_an_earlier_layout_beside_the_versions_is_counted_not_listed(fresh_compiler, caplog):
    # inductor's own folders straight under the cache: what a harvest that kept one cache
    # for every torch left behind (hashed folders, fxgraph, a lock file)
    for name in ("2d", "fxgraph", "aotautograd", "3w"):
        (fresh_compiler.parent / name).mkdir(parents=True)
    (fresh_compiler.parent / "cache.lock").write_text("")
    (fresh_compiler.parent / "2.12.1+cu128").mkdir()
    with caplog.at_level(logging.WARNING, logger="harvest"):
        compiled_units.use_harvest_cache()
    warnings = [r.getMessage() for r in caplog.records if "trainer.compile" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "compiled artifacts of torch 2.12.1+cu128 under" in warnings[0]
    assert "5 entries directly under" in warnings[0] and "fxgraph" not in warnings[0] and "aotautograd" not in warnings[0]


def test_a_layer_whose_backward_cannot_compile_runs_eager_from_its_first_call(fresh_compiler, caplog):
    from torch._dynamo.backends.common import aot_autograd

    def backward_fails(graph_module, example_inputs):
        raise RuntimeError("this backward compiler compiles nothing")

    backend = aot_autograd(fw_compiler=lambda gm, _: gm.forward, bw_compiler=backward_fails)
    x, grad = torch.randn(4, 16), torch.randn(4, 16)
    torch.manual_seed(0)
    expected = _step(_Block(), x, grad)
    torch.manual_seed(0)
    block = _Block()
    state = compiled_units.compile_layers([block], "on", torch.device("cpu"), backend=backend)
    with caplog.at_level(logging.WARNING, logger="harvest"):
        out = _step(block, x, grad)
    assert [torch.equal(a, b) for a, b in zip(out, expected)] == [True] * 3
    assert state.layers == 0 and "this backward compiler compiles nothing" in state.reason
    assert block._compiled_call_impl is None
    assert not [p for p in fresh_compiler.parent.iterdir() if ".aside-" in p.name]  # not the cache's fault
