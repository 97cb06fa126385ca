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
