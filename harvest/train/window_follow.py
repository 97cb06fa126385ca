"""The trainer's window in lent memory: it follows the lending budget between units.

When the window's allocator has a ``budget`` (harvest.memory.lent_budget), the decode
side publishes how much lent KV memory the window may hold and how much it wants back;
the trainer applies each new budget generation at unit boundaries (and while parked at
its gate) and acknowledges it, which is what an urgent reclaim waits for.
"""

from __future__ import annotations

import threading

from harvest.train.window import WeightWindow


class LentWindowFollower:
    """Resizes ``window`` to the latest lent-memory budget, under the trainer's unit lock
    (``unit_lock``: held while a unit runs, so a change lands between units)."""

    def __init__(self, window: WeightWindow, unit_lock: threading.Lock):
        self.window = window
        self._unit_lock = unit_lock
        self._budget_generation = -1  # the budget's generation the window last applied

    @property
    def holds_lent_window(self) -> bool:
        """The window lives in lent KV memory (it follows the lending budget)."""
        return self.window.allocator.budget is not None

    def set_stages(self, num_stages: int) -> int:
        """Change W between units (waits for the running unit, at most one). Shrinking frees
        memory before returning; growing takes effect as the next units run. Returns the
        bytes the window holds afterwards."""
        with self._unit_lock:
            self.window.set_capacity(num_stages)
            return self.window.held_bytes

    def release(self) -> int:
        """Free all of the window's memory between units (a unit that needs a stage loads it
        again). Returns the bytes the window holds afterwards (0 unless weights are shared)."""
        with self._unit_lock:
            self.window.evict_all()
            return self.window.held_bytes

    def follow(self) -> None:
        """Apply the lent-memory budget now (the trainer thread, parked at its gate)."""
        with self._unit_lock:
            self.follow_locked()

    def follow_locked(self) -> None:
        """Under the unit lock: fit the window to the latest published budget, once per
        generation. W becomes the most stages whose worst case fits ``limit_bytes``; if the
        memory wanted back is still not free as whole chunks (the window's buffers straddle
        them), the window empties (the next unit loads its stage again). Then acknowledge:
        an urgent reclaim waits for exactly that."""
        allocator = self.window.allocator
        budget = allocator.budget
        if budget is None:
            return
        snapshot = budget.snapshot
        if snapshot.generation == self._budget_generation:
            return
        stages = self.window.capacity_for_bytes(snapshot.limit_bytes)
        if stages >= 1 and stages != self.window.capacity:
            self.window.set_capacity(stages)
        if snapshot.wanted_back_bytes and allocator.reclaimable_bytes() < snapshot.wanted_back_bytes:
            self.window.evict_all()
        self._budget_generation = snapshot.generation
        budget.acknowledge(snapshot.generation)
