"""The trainer's window in lent memory (the unified allocator's general arena, host
backend) follows the lending budget: it shrinks at its own unit boundaries, gives memory
back while parked at its gate, and releases everything when it leaves its loop. The
memory side only publishes; nothing here calls into the trainer from outside. A view of
a window buffer kept past its release and the reclaim of its chunks reads the arena's
dummy run, never the KV cache (issue 18, defect 3)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from harvest.memory import UnifiedAllocator
from harvest.memory.lent_budget import LentMemoryBudget
from harvest.train.arena_window import ArenaWindowAllocator
from harvest.train.gate import Gate
from tests.train.trainer_helpers import (PARK_TIMEOUT_S, build, job_dict, lora_params, max_abs_diff,
                                         randomize_lora_b, trainer_thread)

NUM_CHUNKS = 32  # chunk 0 stays mapped, as SGLang's padding chunk does
LENT = list(range(1, NUM_CHUNKS))


@pytest.fixture
def lent_arena():
    # The tiny models' KV geometry with 16 KiB pages: 64 KiB chunks; the tiny Llama's
    # stages (~130-150 KiB each) all fit in the 31 lent chunks.
    alloc = UnifiedAllocator(num_layers=2, kv_heads=2, head_dim=16, dtype_bytes=4, max_tokens=NUM_CHUNKS * 128,
                             page_bytes=16 * 1024)
    alloc.lend(LENT)
    budget = LentMemoryBudget()
    budget.publish(lent_bytes=len(LENT) * alloc.geometry.chunk_bytes, wanted_back_bytes=0)
    yield alloc, budget
    alloc.check_integrity()


def arena_trainer(model_path, output_dir, alloc, budget, **overrides):
    from harvest.train.build import build_trainer
    from harvest.train.job import load_job

    job = load_job(job_dict(model_path, output_dir, **overrides))
    return build_trainer(job, allocator=ArenaWindowAllocator(alloc, "cpu", budget))


def run_steps(trainer, num_steps: int) -> None:
    target = trainer.global_step + num_steps
    while trainer.global_step < target:
        trainer.run_one_unit()


@pytest.mark.timeout(120)
def test_the_trainer_shrinks_at_a_unit_boundary_on_a_published_budget(tiny_llama_path, tmp_path, lent_arena):
    alloc, budget = lent_arena
    chunk_bytes = alloc.geometry.chunk_bytes
    reference = build(tiny_llama_path, tmp_path / "ref")
    trainer = arena_trainer(tiny_llama_path, tmp_path / "lent", alloc, budget)
    randomize_lora_b(reference)
    randomize_lora_b(trainer)
    run_steps(reference, 2)
    run_steps(trainer, 1)
    window = trainer.window
    assert window.capacity == trainer.split.num_stages == 4
    assert len(window.resident_stages()) == 4

    kept = 5  # chunks: two stages fit, three do not
    assert window.capacity_for_bytes(kept * chunk_bytes) == 2
    wanted_back = (len(LENT) - kept) * chunk_bytes
    trainer._unit_lock.acquire()  # a unit is running on the trainer thread
    try:
        generation = budget.publish(lent_bytes=len(LENT) * chunk_bytes, wanted_back_bytes=wanted_back)
        assert window.capacity == 4 and len(window.resident_stages()) == 4  # publishing touched nothing
        assert budget.acknowledged_generation < generation
    finally:
        trainer._unit_lock.release()
    trainer.run_one_unit()  # its boundary: the trainer applies the budget itself
    assert window.capacity == 2 and window.held_bytes <= kept * chunk_bytes
    assert budget.acknowledged_generation == generation
    assert alloc.stats().chunks_lent_idle * chunk_bytes >= wanted_back  # free as whole chunks
    assert window.allocator.allocate(16 * 1024) is None  # nothing new while memory is wanted back

    taken = sorted(alloc.reclaimable_chunks())[: len(LENT) - kept]  # the memory side takes them
    alloc.reclaim(taken)
    budget.publish(lent_bytes=kept * chunk_bytes, wanted_back_bytes=0)
    trainer.run_one_unit()
    assert window.capacity == 2 and window.held_bytes <= kept * chunk_bytes

    alloc.lend(taken)  # lent again: the window grows back at the next boundary
    budget.publish(lent_bytes=len(LENT) * chunk_bytes, wanted_back_bytes=0)
    run_steps(trainer, 1)
    assert window.capacity == 4
    assert max_abs_diff(lora_params(reference.split.peft_model), lora_params(trainer.split.peft_model)) == 0.0
    trainer.close()


class PauseAfterUnits:
    def __init__(self, gate: Gate, num_units: int):
        self.gate = gate
        self.remaining = num_units

    def __call__(self, record) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.gate.pause()


@pytest.mark.timeout(600)
def test_a_parked_trainer_gives_memory_back_and_releases_it_when_it_leaves(tiny_llama_path, tmp_path, lent_arena):
    alloc, budget = lent_arena
    chunk_bytes = alloc.geometry.chunk_bytes
    trainer = arena_trainer(tiny_llama_path, tmp_path, alloc, budget, max_steps=2)
    evicted_on = []
    evict_all = trainer.window.evict_all
    trainer.window.evict_all = lambda: (evicted_on.append(threading.current_thread().name), evict_all())[1]

    gate = Gate()
    with trainer_thread(trainer, gate, on_unit=PauseAfterUnits(gate, 3)) as outcome:
        assert gate.wait_until_parked(timeout=PARK_TIMEOUT_S)
        assert budget.followed and trainer.window.held_bytes > 0
        units = trainer.stats().units_run

        generation = budget.publish(lent_bytes=len(LENT) * chunk_bytes, wanted_back_bytes=len(LENT) * chunk_bytes)
        assert budget.wait_acknowledged(generation, timeout_s=10)
        assert trainer.window.held_bytes == 0 and alloc.stats().chunks_lent_idle == len(LENT)
        assert evicted_on == ["trainer"]  # the trainer thread let go, between waits at its gate
        assert gate.paused and trainer.stats().units_run == units  # and is still parked
        alloc.reclaim(LENT)
        budget.publish(lent_bytes=0, wanted_back_bytes=0)

        alloc.lend(LENT)
        budget.publish(lent_bytes=len(LENT) * chunk_bytes, wanted_back_bytes=0)
        gate.resume()
    assert outcome == ["finished"]
    # Nobody follows the budget any more, so nothing lent stays with the trainer.
    assert not budget.followed and trainer.window.held_bytes == 0
    assert alloc.stats().chunks_lent_idle == len(LENT)


# In a child interpreter: a regression (no dummy page behind reclaimed arena memory) is a
# SIGSEGV there, a failed test here.
STALE_WINDOW_BUFFER = """
import json, torch
from harvest.memory import UnifiedAllocator
from harvest.train.arena_window import ArenaWindowAllocator
alloc = UnifiedAllocator(num_layers=2, kv_heads=2, head_dim=16, dtype_bytes=4, max_tokens=4 * 128,
                         page_bytes=16 * 1024)
g = alloc.geometry
alloc.lend([1, 2, 3])
window = ArenaWindowAllocator(alloc, "cpu")
buffer = window.allocate(g.chunk_bytes)
weight = buffer[: 64 * 4].view(torch.float32)  # a stage's frozen weight a module still holds
weight.fill_(0.5)
window.release(buffer)  # the window let go of the buffer, not every view of it
del buffer
reclaimed = sorted(alloc.reclaimable_chunks())
alloc.reclaim(reclaimed)
kv = alloc.kv_tensor(0, "k", torch.float32)
kv.fill_(7.0)  # decode fills the reclaimed chunks with new KV
weight.mul_(3.0)  # the stale view is used again: no fault, and not the KV
print(json.dumps({"reclaimed": reclaimed, "kv_intact": bool(torch.all(kv == 7.0)), "held": window.held_bytes}))
"""


def test_a_window_buffer_view_used_after_release_and_reclaim_cannot_touch_the_kv_cache():
    out = subprocess.run([sys.executable, "-c", STALE_WINDOW_BUFFER], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"exit {out.returncode} (negative: killed by that signal): {out.stderr[-2000:]}"
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"reclaimed": [1, 2, 3], "kv_intact": True, "held": 0}
