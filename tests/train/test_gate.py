"""The gate: pause holds all state and resumes exactly (mid-backward included); stop
checkpoints first. Threaded tests run under timeouts."""

from __future__ import annotations

import threading
import time

import pytest

from harvest.train.gate import Gate, GateAction
from harvest.train.stats import UnitKind
from tests.train.trainer_helpers import (PARK_TIMEOUT_S, build, lora_params, max_abs_diff, randomize_lora_b,
                                         trainer_thread)


@pytest.mark.timeout(20)
def test_gate_blocks_while_paused_and_says_stop():
    gate = Gate(stream="s0")
    assert gate.acquire().action == GateAction.RUN
    gate.pause()
    decisions = []
    worker = threading.Thread(target=lambda: decisions.append(gate.acquire()))
    worker.start()
    assert gate.wait_until_parked(timeout=5)
    time.sleep(0.05)
    assert decisions == []  # still held
    gate.set_stream("s1")
    gate.resume()
    worker.join(timeout=5)
    assert decisions[0].action == GateAction.RUN and decisions[0].stream == "s1" and decisions[0].was_paused
    gate.pause()
    worker = threading.Thread(target=lambda: decisions.append(gate.acquire()))
    worker.start()
    assert gate.wait_until_parked(timeout=5)
    gate.stop()  # stop wins over pause
    worker.join(timeout=5)
    assert decisions[1].action == GateAction.STOP


@pytest.mark.timeout(20)
def test_a_wake_runs_while_parked_on_the_parked_thread_which_keeps_waiting():
    gate = Gate()
    gate.wake()  # while running: nothing to do, the trainer is at a boundary anyway
    ran_on = []
    assert gate.acquire(while_parked=lambda: ran_on.append("early")).action == GateAction.RUN
    assert ran_on == []
    gate.pause()
    decisions = []
    worker = threading.Thread(name="trainer", target=lambda: decisions.append(
        gate.acquire(while_parked=lambda: ran_on.append(threading.current_thread().name))))
    worker.start()
    assert gate.wait_until_parked(timeout=5)
    gate.wake()
    deadline = time.monotonic() + 5
    while not ran_on and time.monotonic() < deadline:
        time.sleep(0.001)
    assert ran_on == ["trainer"]
    time.sleep(0.05)
    assert decisions == [] and gate.wait_until_parked(timeout=1)  # parked again, not released
    gate.resume()
    worker.join(timeout=5)
    assert decisions[0].action == GateAction.RUN and decisions[0].was_paused and ran_on == ["trainer"]


def test_wait_until_parked_times_out():
    assert Gate().wait_until_parked(timeout=0.01) is False


class PauseAt:
    """Pause the gate right after the first unit matching (step, kind, stage)."""

    def __init__(self, gate: Gate, step: int, kind: UnitKind, stage: int):
        self.gate, self.target, self.fired = gate, (step, kind, stage), False

    def __call__(self, record) -> None:
        if not self.fired and (record.step, record.kind, record.stage) == self.target:
            self.fired = True
            self.gate.pause()


@pytest.mark.timeout(600)
def test_pause_mid_backward_then_resume_is_identical(tiny_llama_path, tmp_path):
    reference = build(tiny_llama_path, tmp_path / "ref", harvest={"window_stages": 2})
    paused = build(tiny_llama_path, tmp_path / "paused", harvest={"window_stages": 2})
    randomize_lora_b(reference)
    randomize_lora_b(paused)
    assert reference.run(Gate()) == "finished"

    gate = Gate()
    # Pause after step 1's backward of the top layer: lower layers' backward still to run.
    top_layer = paused.split.num_layers
    with trainer_thread(paused, gate, on_unit=PauseAt(gate, 1, UnitKind.BACKWARD, top_layer)) as outcome:
        assert gate.wait_until_parked(timeout=PARK_TIMEOUT_S)
        units_at_pause = paused.stats().units_run
        assert paused.next_unit().kind == UnitKind.BACKWARD  # mid-backward
        # Reclaim while paused: the window shrinks at once (no unit is running).
        held = paused.set_window_stages(1)
        assert held <= max(paused.window.stage_bytes())
        time.sleep(0.2)
        assert paused.stats().units_run == units_at_pause  # held, not running
        paused.set_window_stages(2)
        gate.resume()
    assert outcome == ["finished"]
    stats = paused.stats()
    assert stats.pauses == 1 and stats.paused_s >= 0.2
    assert max_abs_diff(lora_params(reference.split.peft_model), lora_params(paused.split.peft_model)) == 0.0
    assert _losses(tmp_path / "ref") == _losses(tmp_path / "paused")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("compile_layers", ["off", pytest.param("on", marks=pytest.mark.slow)])
def test_stop_mid_step_checkpoints_and_resume_finishes_identically(compile_layers, tiny_llama_path, tmp_path):
    # Compiled, the stopped and the resumed trainer still match the eager reference bit for
    # bit (harvest.train.eager_numerics), LoRA dropout included.
    overrides = dict(max_steps=4, save_steps=100, lora_dropout=0.1)
    reference = build(tiny_llama_path, tmp_path / "ref", compile_layers="off", **overrides)
    assert reference.run(Gate()) == "finished"

    first = build(tiny_llama_path, tmp_path / "run", compile_layers=compile_layers, **overrides)
    gate = Gate()
    with trainer_thread(first, gate, on_unit=PauseAt(gate, 2, UnitKind.BACKWARD, first.split.head_stage)) as outcome:
        assert gate.wait_until_parked(timeout=PARK_TIMEOUT_S if compile_layers == "off" else 240)  # a cold compile
        gate.stop()
    assert outcome == ["stopped"]
    assert first.stats().state == "stopped"
    # Two steps were complete; the third was mid-backward and is redone after resume.
    assert (tmp_path / "run" / "checkpoint-2" / "harvest_state.json").is_file()
    assert not (tmp_path / "run" / "checkpoint-3").exists()

    # LlamaFactory picks checkpoint-2.
    resumed = build(tiny_llama_path, tmp_path / "run", compile_layers=compile_layers, **overrides)
    assert resumed.global_step == 2
    assert resumed.run(Gate()) == "finished"
    assert max_abs_diff(lora_params(reference.split.peft_model), lora_params(resumed.split.peft_model)) == 0.0
    assert _losses(tmp_path / "ref") == _losses(tmp_path / "run")


def _losses(output_dir) -> dict[int, float]:
    import json

    entries = [json.loads(line) for line in (output_dir / "trainer_log.jsonl").read_text().splitlines()]
    return {entry["current_steps"]: entry["loss"] for entry in entries}  # a redone step keeps its last value


@pytest.mark.timeout(600)
def test_a_failing_threaded_test_leaves_no_trainer_running(tiny_llama_path, tmp_path):
    """The helper the threaded tests use: when a test fails mid-run, its trainer is stopped
    and joined before the failure propagates (a trainer left running drew dropout masks
    from the generators of the tests after it, which failed in turn: seen once)."""
    trainer = build(tiny_llama_path, tmp_path / "run", max_steps=50, save_steps=100)
    gate = Gate()
    with pytest.raises(AssertionError, match="the test failed here"):
        with trainer_thread(trainer, gate) as outcome:
            assert gate.wait_until_parked(timeout=0.01) is False  # running, not parked
            raise AssertionError("the test failed here")
    assert outcome == ["stopped"]
    assert not [t for t in threading.enumerate() if t.name == "trainer" and t.is_alive()]
