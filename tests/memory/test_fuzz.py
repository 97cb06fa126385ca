"""100,000 random operations with every invariant checked after each one."""

from __future__ import annotations

import pytest

from harvest.memory.fuzz import run_fuzz


@pytest.mark.timeout(300)
def test_randomized_operations_keep_every_invariant(make_allocator):
    # The full count, not a reduced one: the library's check_integrity and the Python
    # model's comparison run after every step (about 10 s on 2 cores).
    alloc = make_allocator()
    report = run_fuzz(alloc, ops=100_000, seed=2024)
    assert report.violations == 0, report.first_violation
    assert report.leak_free_at_end
    # The run exercised both sides of every decision, not just one.
    for outcome in ("lend_ok", "lend_refused", "reclaim_ok", "reclaim_refused", "arena_alloc_ok",
                    "arena_alloc_exhausted", "small_alloc_ok", "small_alloc_exhausted", "refusals_checked"):
        assert report.outcomes.get(outcome, 0) >= 200, (outcome, report.outcomes)
    # Lends that waited for their fences, then completed or were cancelled.
    for outcome in ("lend_pending", "lend_finished", "lend_cancelled"):
        assert report.outcomes.get(outcome, 0) >= 50, (outcome, report.outcomes)


def test_fuzz_detects_a_broken_allocator(make_allocator, monkeypatch):
    """The checker is not vacuous: an allocator whose stats lie is caught at once."""
    alloc = make_allocator()
    real_stats = alloc.stats

    def lying_stats():
        import dataclasses

        stats = real_stats()
        return dataclasses.replace(stats, arena_allocations=stats.arena_allocations + 1)

    monkeypatch.setattr(alloc, "stats", lying_stats)
    report = run_fuzz(alloc, ops=50, seed=1)
    assert report.violations > 0 and "arena_allocations" in report.first_violation
