"""The step hook's overhead accounting (``/harvest/status``): the engine's time is left
out, and each part of the control (decide before the step, feedback and lending after it)
is timed on its own, so a slow part shows where it is."""

from __future__ import annotations

import time
import types

import pytest

from harvest.colocate.step_timer import CpuStepTimer
from harvest.sglang.runtime import HOOK_PARTS, HarvestRuntime

forward_batch_info = pytest.importorskip("sglang.srt.model_executor.forward_batch_info")

# Busy-waits of clearly different lengths (a CPU-time clock counts them too; a sleep it
# would not). The engine takes longer than all of them together: it must not be counted.
DECIDE_S, FEEDBACK_S, LENDING_S, ENGINE_S = 0.002, 0.006, 0.018, 0.060


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _Control:
    decode_stream = None
    level = types.SimpleNamespace(decode_sms=1, trainer_sms=1)
    qos = types.SimpleNamespace(stats=lambda: types.SimpleNamespace(to_dict=dict))

    def __init__(self):
        self.loads, self.measured = [], []

    def before_step(self, load):
        self.loads.append(load)
        _spin(DECIDE_S)

    def after_step(self, measured_s):
        self.measured.append(measured_s)
        _spin(FEEDBACK_S)

    def record_steps(self):
        pass


class _Lending:
    num_lent = 0
    policy = types.SimpleNamespace(num_chunks=4)

    def after_step(self):
        _spin(LENDING_S)

    def maybe_lend(self):
        pass

    def stats(self):
        return {"fragmentation_bytes": 0}


def _runtime():
    metrics = types.SimpleNamespace(set_kv_chunks=lambda **kwargs: None)
    config = types.SimpleNamespace(qos=types.SimpleNamespace(target_tpot_ms=40.0),
                                   trainer=types.SimpleNamespace(cpu_threads=1, nice=2))
    runtime = HarvestRuntime(config=config, control=_Control(), lending=_Lending(), trainer_host=None,
                             timer=CpuStepTimer(), metrics=metrics, partitioner=types.SimpleNamespace(description="cpu", current_index=0),
                             refiner=None, device_type="cpu")
    runtime.ACCOUNT_EVERY = 1  # account every step (7 on a server)
    return runtime


def test_hook_accounting_leaves_the_engine_out_and_times_each_part():
    runtime = _runtime()
    batch = types.SimpleNamespace(reqs=[object()] * 4, seq_lens_sum=400,
                                  forward_mode=forward_batch_info.ForwardMode.DECODE)

    def engine(scheduler, batch):
        _spin(ENGINE_S)
        return "result"

    results = [runtime.run_step(engine, None, batch) for _ in range(5)]
    status = runtime.status()

    assert results == ["result"] * 5 and len(runtime.control.measured) == 5
    assert min(runtime.control.measured) >= ENGINE_S  # the step timer measured the engine
    parts = status["hook_wall_us_median_by_part"]
    assert tuple(parts) == HOOK_PARTS == ("decide", "feedback", "lending")
    # Each part at least its own busy-wait, and under the next part's (the waits differ 3x).
    assert DECIDE_S * 1e6 <= parts["decide"] < FEEDBACK_S * 1e6 <= parts["feedback"] < LENDING_S * 1e6 <= parts["lending"]
    own = (DECIDE_S + FEEDBACK_S + LENDING_S) * 1e6
    assert own <= status["hook_wall_us_median"] < ENGINE_S * 1e6  # the engine is left out
    assert status["hook_cpu_us_median"] < ENGINE_S * 1e6
    assert status["hook_cpu_us_median"] > 0.5 * own  # busy-waits are CPU time (unless the OS took the CPU away)


def test_prebuilt_and_idle_batches_pass_straight_through_unaccounted():
    runtime = _runtime()
    ForwardMode = forward_batch_info.ForwardMode
    batch = types.SimpleNamespace(reqs=[], seq_lens_sum=0, forward_mode=ForwardMode.IDLE)
    assert runtime.run_step(lambda scheduler, b: "idle", None, batch) == "idle"
    assert runtime.num_steps == 0 and not runtime.recent_hook_ns and not runtime.control.loads
    assert runtime.status()["hook_wall_us_median_by_part"] == {part: 0.0 for part in HOOK_PARTS}
