"""What the runtime reads from an SGLang batch each step: the forward modes it passes
through or treats as decode follow SGLang's own predicates, evaluated once."""

from __future__ import annotations

import types

import pytest

from harvest.colocate import StepLoad
from harvest.sglang.runtime import forward_mode_sets, observe

forward_batch_info = pytest.importorskip("sglang.srt.model_executor.forward_batch_info")
ForwardMode = forward_batch_info.ForwardMode


def test_mode_sets_agree_with_sglangs_predicates_for_every_mode():
    passthrough, decode = forward_mode_sets()
    assert passthrough and decode
    for mode in ForwardMode:
        assert (mode in passthrough) == bool(mode.is_idle() or mode.is_prebuilt()), mode
        assert (mode in decode) == bool(mode.is_decode()), mode


def test_observe_reads_batch_size_context_and_decode():
    _, decode = forward_mode_sets()
    batch = types.SimpleNamespace(reqs=[object()] * 3, seq_lens_sum=420, forward_mode=ForwardMode.DECODE)
    assert observe(batch, decode) == StepLoad(3, 420, True)
    batch = types.SimpleNamespace(reqs=[object()] * 2, seq_lens_sum=None, forward_mode=ForwardMode.EXTEND)
    assert observe(batch, decode) == StepLoad(2, 0, False)


def test_idle_and_prebuilt_batches_pass_straight_through_the_step_loop():
    from harvest.sglang.runtime import HarvestRuntime

    class _Colocation:
        steps = []

        def run_step(self, load, run, *args):
            self.steps.append(load)
            return run(*args)

    runtime = HarvestRuntime.__new__(HarvestRuntime)
    runtime.colocation = _Colocation()
    runtime.reporter = types.SimpleNamespace(due=lambda: False)  # no snapshot due
    runtime._passthrough_modes, runtime._decode_modes = forward_mode_sets()
    for mode in runtime._passthrough_modes:
        batch = types.SimpleNamespace(reqs=[], seq_lens_sum=0, forward_mode=mode)
        assert runtime.run_step(lambda scheduler, b: "passed", None, batch) == "passed"
    assert runtime.colocation.steps == []
    batch = types.SimpleNamespace(reqs=[object()], seq_lens_sum=7, forward_mode=ForwardMode.DECODE)
    assert runtime.run_step(lambda scheduler, b: "stepped", None, batch) == "stepped"
    assert runtime.colocation.steps == [StepLoad(1, 7, True)]
